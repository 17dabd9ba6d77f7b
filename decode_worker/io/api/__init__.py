"""The router-compatible HTTP API over a `GenerateBackend` (see backend.py for the seam)."""

from decode_worker.io.api.app import ApiApp, check_model_path
from decode_worker.io.api.backend import (
    FlushResult,
    GenerateBackend,
    GenerateInput,
    Health,
    Load,
    OutputChunk,
    Tokenizer,
)
from decode_worker.io.api.common import ApiConfig

__all__ = [
    "ApiApp",
    "ApiConfig",
    "FlushResult",
    "GenerateBackend",
    "GenerateInput",
    "Health",
    "Load",
    "OutputChunk",
    "Tokenizer",
    "check_model_path",
]
