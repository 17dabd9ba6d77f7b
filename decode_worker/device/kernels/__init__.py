"""Triton kernels of the decode step (CUDA), each with a torch reference in the layer above.

On CPU the torch paths run; the kernels' tests run them under Triton's interpreter
(`TRITON_INTERPRET=1`, set by tests/conftest.py when no CUDA device is visible).
"""
