"""Sampling parameters of one request (pure; parsed by io/api, applied by device/sampler)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Literal

from decode_worker.errors import ClientError

MAX_TOP_LOGPROBS = 20  # most alternatives a request may ask for per token (OpenAI's bound)
TopLogprobs = list[tuple[int, float]]  # (token id, logprob), most likely first


def check_top_logprobs(n: int | None, field_name: str) -> int:
    """`n` as a count of alternatives per token; ClientError outside [0, MAX_TOP_LOGPROBS]."""
    if n is None:
        return 0
    if not 0 <= n <= MAX_TOP_LOGPROBS:
        raise ClientError(f"{field_name} must be in [0, {MAX_TOP_LOGPROBS}], got {n}")
    return n


GrammarKind = Literal["json_schema", "json_object", "regex", "ebnf", "structural_tag"]
GRAMMAR_KINDS: tuple[GrammarKind, ...] = ("json_schema", "json_object", "regex", "ebnf",
                                          "structural_tag")


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """A constraint on the output text (structured output), compiled by device/grammar.py.

    `source` is the JSON schema text (json_schema), the regular expression (regex), the
    grammar in xgrammar's EBNF (ebnf) or xgrammar's structural tag as JSON (structural_tag: a
    forced tool call, whose special tokens it names by id); json_object takes none ("").
    Hashable: the compiled grammar is cached by spec.
    """

    kind: GrammarKind
    source: str = ""

    def validate(self) -> None:
        """Cheap checks only (compiling is the device's): raise ClientError naming the kind."""
        if self.kind not in GRAMMAR_KINDS:
            raise ClientError(f"grammar kind {self.kind!r}: must be one of {GRAMMAR_KINDS}")
        if self.kind == "json_object":
            return
        if not self.source.strip():
            raise ClientError(f"{self.kind}: empty")
        if self.kind in ("json_schema", "structural_tag"):
            try:
                schema = json.loads(self.source)
            except ValueError as exc:
                raise ClientError(f"{self.kind} is not valid JSON: {exc}") from None
            if not isinstance(schema, dict | bool) or (
                    self.kind == "structural_tag" and not isinstance(schema, dict)):
                raise ClientError(f"{self.kind} must be a JSON object")


def pick_grammar(candidates: dict[str, GrammarSpec | None]) -> GrammarSpec | None:
    """The one grammar among a request's fields (field name -> its spec or None), validated;
    ClientError naming the fields when more than one is set."""
    given = {name: spec for name, spec in candidates.items() if spec is not None}
    if len(given) > 1:
        raise ClientError(f"give at most one output constraint, got {', '.join(sorted(given))}")
    spec = next(iter(given.values()), None)
    if spec is not None:
        spec.validate()
    return spec


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    temperature 0 means greedy (argmax). top_k 0 or less means off; top_p 1.0 off; min_p 0.0 off.
    `seed` makes a sampled request reproducible. Stop tokens and strings end generation; the stop
    string itself is trimmed from the text unless `no_stop_trim`. `grammar` (structured output)
    limits the tokens to those its grammar allows; `extra` carries what the device attaches
    (the compiled grammar, device/grammar.py) and is left out of comparisons.
    """

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    no_stop_trim: bool = False
    skip_special_tokens: bool = True
    grammar: GrammarSpec | None = None
    extra: dict[str, object] = field(default_factory=dict, compare=False)

    @property
    def is_greedy(self) -> bool:
        return self.temperature <= 0.0 or self.top_k == 1

    def validate(self) -> None:
        """Raise ClientError naming the bad field; the request is answered 400."""
        if self.max_new_tokens < 0:
            raise ClientError(f"max_new_tokens={self.max_new_tokens}: must be >= 0")
        if self.temperature < 0.0:
            raise ClientError(f"temperature={self.temperature}: must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise ClientError(f"top_p={self.top_p}: must be in (0, 1]")
        if not 0.0 <= self.min_p <= 1.0:
            raise ClientError(f"min_p={self.min_p}: must be in [0, 1]")
        if self.top_k == 0 or self.top_k < -1:
            raise ClientError(f"top_k={self.top_k}: must be -1 (off) or >= 1")
        if any(not s for s in self.stop):
            raise ClientError("stop: empty stop strings are not allowed")
        if self.grammar is not None:
            self.grammar.validate()
