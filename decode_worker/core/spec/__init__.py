"""Model-free drafting for speculative decoding: drafts from what the worker already holds
(the request's own tokens, the requests it finished and, for NGRAM, the other requests
running now). `Drafter` is the contract the decode step relies on; `make_drafter` builds
NGRAM or SUFFIX from `SpecParams`."""

from decode_worker.core.spec.drafter import (
    Algorithm,
    Drafter,
    DrafterStats,
    SpecParams,
    make_drafter,
)
from decode_worker.core.spec.ngram import NgramDrafter
from decode_worker.core.spec.suffix import SuffixDrafter

__all__ = [
    "Algorithm",
    "Drafter",
    "DrafterStats",
    "NgramDrafter",
    "SpecParams",
    "SuffixDrafter",
    "make_drafter",
]
