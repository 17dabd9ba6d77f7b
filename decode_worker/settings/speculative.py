"""The `speculative` settings section: model-free speculative decoding under SGLang's names
(`--speculative-algorithm NGRAM|SUFFIX`, `--speculative-num-draft-tokens`, the algorithms'
own knobs). Drafts come from what the worker holds (core/spec); no draft model runs."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from decode_worker.core.spec import SpecParams

MAX_DRAFT_TOKENS = 32  # SGLang's SUFFIX docs advise 32 for agentic and code-editing work
# SGLang's (and its forks') algorithms that run a draft model or draft heads
DRAFT_MODEL_ALGORITHMS = frozenset(
    {"EAGLE", "EAGLE3", "NEXTN", "MTP", "STANDALONE", "DFLASH", "FROZEN_KV_MTP", "PHOENIX"})
# SGLang's num-draft-tokens when unset: NGRAM's max match window, SUFFIX's 24
_SGLANG_SUFFIX_DRAFT_TOKENS = 24


class SpeculativeSettings(BaseModel):
    """Model-free speculative decoding (SGLang's `--speculative-*` flags)."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)

    algorithm: Literal["none", "NGRAM", "SUFFIX"] = Field(
        "none", description="Speculative decoding: NGRAM (prompt lookup in the request's own "
        "tokens and a shared memory of finished requests) or SUFFIX (suffix decoding: the "
        "request's tokens and past responses, frequency-weighted); none = off. Any case is "
        "read (SGLang's --speculative-algorithm); draft-model algorithms (EAGLE, EAGLE3, "
        "NEXTN, STANDALONE, ...) are refused at start-up"
    )
    num_draft_tokens: int | None = Field(
        None, ge=1, le=MAX_DRAFT_TOKENS, description="Most draft tokens per request and step "
        f"(K, 1-{MAX_DRAFT_TOKENS}); unset = SGLang's default: NGRAM the max match window, "
        f"SUFFIX {_SGLANG_SUFFIX_DRAFT_TOKENS}"
    )
    ngram_min_match_window_size: int = Field(
        1, ge=1, description="NGRAM: shortest suffix of the request's tokens a draft may follow"
    )
    ngram_max_match_window_size: int = Field(
        12, ge=1, le=1024, description="NGRAM: longest suffix matched (a longer match wins)"
    )
    ngram_capacity: int = Field(
        1_000_000, ge=1, description="NGRAM: tokens of finished requests (prompt and output) "
        "kept for later requests, oldest dropped first (about 100 bytes of host memory each)"
    )
    suffix_max_tree_depth: int = Field(
        24, ge=2, le=1024, description="SUFFIX: the pattern is the request's last this many "
        "tokens; match plus draft stay within it"
    )
    suffix_max_cached_requests: int = Field(
        10_000, ge=-1, description="SUFFIX: responses of finished requests kept for later "
        "requests, oldest dropped first (0 = none, -1 = no count limit)"
    )
    suffix_max_cached_tokens: int = Field(
        1_000_000, ge=1, description="SUFFIX: at most this many tokens of those responses "
        "(not an SGLang flag: bounds host memory, about 100 bytes a token)"
    )
    suffix_max_spec_factor: float = Field(
        1.0, gt=0.0, description="SUFFIX: a draft is at most this x the match length tokens "
        "(SGLang's docs advise 2.0 for agentic and code-editing work)"
    )
    suffix_min_token_prob: float = Field(
        0.1, ge=0.0, le=1.0, description="SUFFIX: a draft ends at a token whose estimated "
        "probability (share of the matches that continue so) is below this"
    )

    @field_validator("algorithm", mode="before")
    @classmethod
    def _algorithm_name(cls, value: Any) -> Any:
        if value is None or (isinstance(value, str) and value.strip().lower() in ("", "none")):
            return "none"
        if not isinstance(value, str):
            return value
        name = value.strip().upper()
        if name in DRAFT_MODEL_ALGORITHMS:
            raise ValueError(f"{name} needs a draft model, which this worker does not run "
                             "(model-free: NGRAM or SUFFIX)")
        if name not in ("NGRAM", "SUFFIX"):
            raise ValueError("expected none, NGRAM or SUFFIX")
        return name

    @field_validator("ngram_max_match_window_size")
    @classmethod
    def _window_order(cls, value: int, info: ValidationInfo) -> int:
        low = info.data.get("ngram_min_match_window_size")
        if isinstance(low, int) and low > value:
            raise ValueError(f"must be at least ngram_min_match_window_size ({low})")
        return value

    @property
    def enabled(self) -> bool:
        return self.algorithm != "none"

    @property
    def draft_tokens(self) -> int | None:
        """K in effect (SGLang's default when unset); None when speculation is off."""
        if self.algorithm == "none":
            return None
        if self.num_draft_tokens is not None:
            return self.num_draft_tokens
        if self.algorithm == "NGRAM":
            return min(self.ngram_max_match_window_size, MAX_DRAFT_TOKENS)
        return _SGLANG_SUFFIX_DRAFT_TOKENS

    @property
    def lookahead(self) -> int:
        """Positions a verify step may write past a request's next one (K; 0 when off): the
        SWA ring, the pages and the admission budget keep that much more."""
        k = self.draft_tokens
        return 0 if self.algorithm == "none" or k is None else k

    def params(self) -> SpecParams | None:
        """The drafters' knobs (None when speculation is off)."""
        k = self.draft_tokens
        if self.algorithm == "none" or k is None:
            return None
        return SpecParams(
            algorithm=self.algorithm, num_draft_tokens=k,
            ngram_min_match_window_size=self.ngram_min_match_window_size,
            ngram_max_match_window_size=self.ngram_max_match_window_size,
            ngram_capacity=self.ngram_capacity,
            suffix_max_tree_depth=self.suffix_max_tree_depth,
            suffix_max_cached_requests=self.suffix_max_cached_requests,
            suffix_max_cached_tokens=self.suffix_max_cached_tokens,
            suffix_max_spec_factor=self.suffix_max_spec_factor,
            suffix_min_token_prob=self.suffix_min_token_prob,
        )

    def server_info(self) -> dict[str, Any]:
        """The section under SGLang's `/server_info` keys (`speculative_algorithm` is null
        when off, as SGLang reports it)."""
        on = self.enabled
        return {
            "speculative_algorithm": self.algorithm if on else None,
            "speculative_num_draft_tokens": self.draft_tokens,
            "speculative_ngram_min_match_window_size": self.ngram_min_match_window_size,
            "speculative_ngram_max_match_window_size": self.ngram_max_match_window_size,
            "speculative_ngram_capacity": self.ngram_capacity,
            "speculative_suffix_max_tree_depth": self.suffix_max_tree_depth,
            "speculative_suffix_max_cached_requests": self.suffix_max_cached_requests,
            "speculative_suffix_max_cached_tokens": self.suffix_max_cached_tokens,
            "speculative_suffix_max_spec_factor": self.suffix_max_spec_factor,
            "speculative_suffix_min_token_prob": self.suffix_min_token_prob,
        }
