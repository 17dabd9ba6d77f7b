"""Structured output with xgrammar: compiled grammars (cached), per-request matchers, the mask.

- `GrammarCache` compiles a `GrammarSpec` once (LRU keyed by the spec) over a `TokenizerInfo`
  built from our tokenizer's vocabulary; `cache_for(tokenizer)` is the one cache per tokenizer
  in this process. A spec xgrammar cannot compile is a `ClientError` (400) with its message.
- `prepare_sampling` runs where a request enters (the backends, before the compute thread sees
  it) and attaches the compiled grammar to the params (`SamplingParams.extra`); the compute
  thread never compiles.
- `GrammarState` is one request's matcher. It counts the output tokens it has accepted and
  catches up lazily (`catch_up(output_ids)` before each mask): so the first token, sampled by
  the prefill peer, advances the decode side's grammar, and a retracted request or a step
  committed late loses nothing.
- A structural tag (`structural_tag`: a forced tool call in harmony) names special tokens by id.
  It is compiled over a second view of the vocabulary where each special token has a text no
  other part of a grammar can match (a NUL byte, then its own text: JSON strings exclude
  control characters), so only a `{"type": "token"}` element can produce one; its
  `{"type": "json_schema"}` elements get our JSON grammar (`json_grammar`) instead of xgrammar's.
- `mask_logits` applies the batch's bitmask to the rows with a grammar (one int32 bitmask for
  the batch, one apply call). Ids past the tokenizer's vocabulary (a padded model vocab) are
  masked too. A terminated matcher allows only its stop tokens (EOS and the request's).

xgrammar is imported where it is first used, not with this module: its import (transformers'
with it) costs seconds at every start of a server, and most never see a grammar.
"""

from __future__ import annotations

import logging
import re
import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from decode_worker.core.sampling import GrammarSpec, SamplingParams
from decode_worker.device.grammar_text import json_grammar, structural_tag
from decode_worker.device.tokenizer import Tokenizer
from decode_worker.errors import ClientError

if TYPE_CHECKING:
    import xgrammar as xgr

log = logging.getLogger(__name__)

MAX_CACHED_GRAMMARS = 256
_EXTRA_KEY = "compiled_grammar"
_XGR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")  # "[21:12:37] /project/cpp/x.cc:94: "
__all__ = ["GrammarCache", "GrammarState", "json_grammar", "mask_logits", "prepare_sampling"]


def token_info(tokenizer: Tokenizer, name_specials: bool = False) -> xgr.TokenizerInfo:
    """xgrammar's view of `tokenizer`: each id's token string (special added tokens as "", which
    xgrammar never allows inside the grammar; with `name_specials`, a NUL byte then their text,
    for structural tags), its vocab type, EOS as the stop tokens."""
    inner = tokenizer.inner
    vocab: list[str] = [""] * tokenizer.vocab_size
    import xgrammar as xgr  # on first use (see the module doc)

    for text, tid in inner.get_vocab(with_added_tokens=True).items():
        vocab[tid] = text
    meta = xgr.TokenizerInfo._detect_metadata_from_hf(inner.to_str())
    nul = chr(256) if meta["vocab_type"] == xgr.VocabType.BYTE_LEVEL else "\x00"  # byte 0
    for tid, added in inner.get_added_tokens_decoder().items():
        if added.special:
            vocab[tid] = nul + added.content if name_specials else ""
    return xgr.TokenizerInfo(vocab, meta["vocab_type"], vocab_size=len(vocab),
                             stop_token_ids=list(tokenizer.eos_token_ids),
                             add_prefix_space=meta["add_prefix_space"])


class GrammarCache:
    """Compiled grammars by spec, least recently used dropped past `max_entries`. Thread-safe:
    the backends compile off the event loop, several at once."""

    def __init__(self, tokenizer: Tokenizer, max_entries: int = MAX_CACHED_GRAMMARS) -> None:
        import xgrammar as xgr  # on first use (see the module doc)

        self.info = token_info(tokenizer)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=2, cache_enabled=False)
        self.max_entries = max_entries
        self._tokenizer = tokenizer
        self._tag_compiler: xgr.GrammarCompiler | None = None  # for structural tags, on demand
        self._compiled: OrderedDict[GrammarSpec, xgr.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self.num_compiled = 0  # compilations done (cache misses)

    def compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        """The compiled grammar of `spec`. Raises ClientError with xgrammar's message."""
        with self._lock:
            hit = self._compiled.get(spec)
            if hit is not None:
                self._compiled.move_to_end(spec)
                return hit
        compiled = self._compile(spec)  # outside the lock: a slow schema blocks no other
        with self._lock:
            self.num_compiled += 1
            self._compiled[spec] = compiled
            while len(self._compiled) > self.max_entries:
                self._compiled.popitem(last=False)
        return compiled

    def _compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        spec.validate()
        try:
            if spec.kind in ("json_schema", "json_object"):
                schema = spec.source if spec.kind == "json_schema" else '{"type": "object"}'
                return self.compiler.compile_grammar(json_grammar(schema))
            if spec.kind == "regex":
                return self.compiler.compile_regex(spec.source)
            if spec.kind == "structural_tag":
                return self._tags().compile_structural_tag(structural_tag(spec.source))
            return self.compiler.compile_grammar(spec.source)
        except (RuntimeError, ValueError, TypeError) as exc:
            message = _XGR_PREFIX.sub("", str(exc).strip())
            raise ClientError(f"{spec.kind} cannot be compiled: {message}") from None

    def _tags(self) -> xgr.GrammarCompiler:
        """The compiler over the vocabulary whose special tokens a grammar can name (see the
        module doc); built on the first structural tag. Called under no lock: two threads may
        both build one, either is right."""
        if self._tag_compiler is None:
            import xgrammar as xgr  # on first use (see the module doc)

            info = token_info(self._tokenizer, name_specials=True)
            self._tag_compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        return self._tag_compiler

    def prepare(self, sampling: SamplingParams) -> SamplingParams:
        """`sampling` with its grammar compiled and attached (itself when it has none)."""
        if sampling.grammar is None or sampling.extra.get(_EXTRA_KEY) is not None:
            return sampling
        compiled = self.compile(sampling.grammar)
        return replace(sampling, extra={**sampling.extra, _EXTRA_KEY: compiled})


_caches: weakref.WeakKeyDictionary[Tokenizer, GrammarCache] = weakref.WeakKeyDictionary()
_caches_lock = threading.Lock()


def cache_for(tokenizer: Tokenizer) -> GrammarCache:
    """The process's one `GrammarCache` for `tokenizer` (built on first use)."""
    with _caches_lock:
        cache = _caches.get(tokenizer)
        if cache is None:
            cache = _caches[tokenizer] = GrammarCache(tokenizer)
        return cache


def prepare_sampling(tokenizer: object, sampling: SamplingParams) -> SamplingParams:
    """`sampling` with its grammar compiled (see `GrammarCache.prepare`); for the backends,
    whose tokenizer is typed by the API's protocol. Raises ClientError (400)."""
    if sampling.grammar is None:
        return sampling
    if not isinstance(tokenizer, Tokenizer):
        raise ClientError("structured output needs the model's own tokenizer")
    return cache_for(tokenizer).prepare(sampling)


class GrammarState:
    """One request's grammar matcher and how many of its output tokens it has accepted.

    Compute thread only. Output ids only grow (a retracted request keeps its tokens), so
    catching up is accepting the ones not yet seen.
    """

    def __init__(self, compiled: xgr.CompiledGrammar, stop_token_ids: Sequence[int] = ()) -> None:
        import xgrammar as xgr  # on first use (see the module doc)

        stops = [*compiled.tokenizer_info.stop_token_ids, *stop_token_ids]
        self.matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=stops)
        self.stop_token_ids = tuple(dict.fromkeys(stops))
        self.vocab_size = int(compiled.tokenizer_info.vocab_size)
        self.num_accepted = 0
        self.rejected: int | None = None  # a token the grammar refused (the peer ignored it)

    @classmethod
    def for_sampling(cls, sampling: SamplingParams) -> GrammarState | None:
        """A fresh state for `sampling`'s grammar; None without one. A grammar that was never
        compiled (`prepare_sampling` skipped) is logged and left unconstrained."""
        if sampling.grammar is None:
            return None
        import xgrammar as xgr  # on first use (see the module doc)

        compiled = sampling.extra.get(_EXTRA_KEY)
        if not isinstance(compiled, xgr.CompiledGrammar):
            log.error("a %s grammar was never compiled: output left unconstrained",
                      sampling.grammar.kind)
            return None
        return cls(compiled, sampling.stop_token_ids)

    def catch_up(self, output_ids: Sequence[int]) -> None:
        """Accept every output token not yet accepted (in order)."""
        for token in output_ids[self.num_accepted:]:
            self.num_accepted += 1
            if self.rejected is None and not self.matcher.is_terminated() and (
                    not self.matcher.accept_token(token)):
                self.rejected = token
                log.warning("token %d is outside the grammar (a prefill peer without it?): "
                            "the rest of the output is left unconstrained", token)

    @property
    def is_active(self) -> bool:
        """False once a token broke the grammar: nothing sensible is left to enforce."""
        return self.rejected is None

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Row `row` of `bitmask` ([bs, ceil(V/32)] i32, CPU) := the tokens allowed next."""
        if self.matcher.is_terminated():  # the grammar is done: only a stop token may follow
            bitmask[row].zero_()
            for token in self.stop_token_ids:
                bitmask[row, token // 32] |= _bit(token % 32)
        else:
            self.matcher.fill_next_token_bitmask(bitmask, row)


def _bit(i: int) -> int:
    """Bit `i` of an int32 word (bit 31 is the sign bit)."""
    return (1 << i) - (1 << 32) if i == 31 else 1 << i


def mask_logits(logits: torch.Tensor, grammars: Sequence[GrammarState | None]) -> torch.Tensor:
    """A copy of `logits` ([bs, V] f32) with every token the row's grammar forbids at -inf;
    `logits` itself stays as it was (logprobs are those of the raw distribution)."""
    active = [(i, g) for i, g in enumerate(grammars) if g is not None and g.is_active]
    if not active:
        return logits
    import xgrammar as xgr  # on first use (see the module doc)

    rows, states = [i for i, _ in active], [g for _, g in active]
    tok_vocab = min(states[0].vocab_size, logits.shape[1])
    bitmask = xgr.allocate_token_bitmask(len(grammars), states[0].vocab_size)  # [bs, W] i32
    for i, state in active:
        state.fill(bitmask, i)
    masked = logits.clone()  # [bs, V]
    xgr.apply_token_bitmask_inplace(masked, bitmask.to(logits.device), vocab_size=tok_vocab,
                                    indices=rows)
    if tok_vocab < logits.shape[1]:  # padded model vocab: ids no token maps to
        masked[rows, tok_vocab:] = float("-inf")
    return masked
