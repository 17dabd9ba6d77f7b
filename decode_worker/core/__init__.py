"""Pure decision logic: page allocator, unified radix tree, request state machine, admission.

Stdlib only. Nothing here imports torch, numpy, zmq, nixl, prometheus_client or asyncio
(tests/unit/core/test_core_is_pure.py enforces it).
"""
