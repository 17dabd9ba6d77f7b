"""Triton kernels of the decode step (CUDA), each with a torch reference in the layer above.

On CPU the torch paths run; the kernels' tests run them under Triton's interpreter
(`TRITON_INTERPRET=1`, set by tests/conftest.py when no CUDA device is visible).
"""

import os

# Under Triton's interpreter (CPU tests) the kernels avoid what it gets wrong (16-bit float dots,
# f32 -> bf16 rounding); read once, when the kernels are first imported, as triton reads it
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
