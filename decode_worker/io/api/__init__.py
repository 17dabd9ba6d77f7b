"""The router-compatible HTTP API over a `GenerateBackend` (see backend.py for the seam)."""

from decode_worker.io.api.app import ApiApp, check_model_path
from decode_worker.io.api.backend import (
    GenerateBackend,
    GenerateInput,
    Health,
    OutputChunk,
    Tokenizer,
)
from decode_worker.io.api.common import ApiConfig

__all__ = [
    "ApiApp",
    "ApiConfig",
    "GenerateBackend",
    "GenerateInput",
    "Health",
    "OutputChunk",
    "Tokenizer",
    "check_model_path",
]
