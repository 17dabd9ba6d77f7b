"""What the compute thread keeps per request beside its core `DecodeRequest`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from decode_worker.core.request import DecodeRequest
from decode_worker.core.sampling import TopLogprobs
from decode_worker.daemon.decode.bridge import AddRequest, Ended, PromptTotals, Tokens
from decode_worker.device.grammar import GrammarState
from decode_worker.device.sampler import SampleRow
from decode_worker.io.api.backend import FinishReason, OutputChunk, SpecCounts

if TYPE_CHECKING:
    from decode_worker.daemon.decode.parking import Parked


class PendingRestore(Protocol):
    """A host -> device restore into a request's pages (`device.host_pool.RestoreHandle`):
    `is_done()` polls without blocking; `wait()` blocks until the copy is done."""

    def is_done(self) -> bool: ...

    def wait(self) -> None: ...


@dataclass(slots=True, eq=False)
class LiveRequest:
    """One request the engine knows: its state machine, what the client asked, its transfer.

    `transfer_id` / `aux_row` are set while a transfer is in flight. `ended` is set by the
    request table's one exit: the answer went out. `restore` is its host-tier restore from
    admission until the request saw it done. `parked` says what it waits for outside the
    prealloc queue and the batch (`parking.py`), before its end or, for its pages, after it.
    """

    req: DecodeRequest
    cmd: AddRequest
    eos_ids: frozenset[int]
    transfer_id: int | None = None
    aux_row: int | None = None
    restore: PendingRestore | None = None
    cached_tokens: int = 0  # prompt tokens not transferred (reused at admission)
    host_cached_tokens: int = 0  # the part of them restored from the host tier
    ended: Ended | None = None
    emitted: int = 0  # output tokens already sent to the client
    row: int = 0  # its row of the running batch (0: not running)
    parked: Parked | None = None  # what it waits for outside the queue and the batch
    # speculative decoding: verify steps it was in, draft tokens proposed for it and kept
    spec_verify_steps: int = 0
    spec_proposed: int = 0
    spec_accepted: int = 0
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[TopLogprobs] = field(default_factory=list)  # when cmd.top_logprobs
    grammar: GrammarState | None = field(default=None, init=False)  # made by the first row
    # the tokens that end it: its stop tokens, and EOS unless it ignores EOS (the one stop rule)
    stop_ids: frozenset[int] = field(init=False)
    _grammar_made: bool = field(default=False, init=False, repr=False)

    def __post_init__(self) -> None:
        sp = self.cmd.sampling
        self.stop_ids = frozenset(sp.stop_token_ids) | (
            frozenset() if sp.ignore_eos else self.eos_ids)

    @property
    def rid(self) -> str:
        return self.req.rid

    @property
    def has_peer(self) -> bool:
        return self.cmd.bootstrap_host is not None and self.cmd.bootstrap_room is not None

    @property
    def has_grammar(self) -> bool:
        """Structured output: its next token depends on every token before it being committed
        (a scheduler runs such a step synchronously)."""
        return self.cmd.sampling.grammar is not None

    def sample_row(self) -> SampleRow:
        """This request's row of the next sample. With a grammar, its matcher first accepts the
        output tokens it has not seen (the first one came from the prefill peer)."""
        if not self._grammar_made:
            self._grammar_made = True
            self.grammar = GrammarState.for_sampling(self.cmd.sampling)
        if self.grammar is not None:
            self.grammar.catch_up(self.req.output_ids)
        return SampleRow(self.cmd.sampling, step=len(self.req.output_ids),
                         return_logprob=self.cmd.return_logprob,
                         top_logprobs=self.cmd.top_logprobs, grammar=self.grammar)

    def record_logprobs(self, logprob: float | None, top: TopLogprobs | None) -> None:
        """Keep the new token's logprob (and its alternatives when asked for)."""
        self.logprobs.append(logprob if logprob is not None else 0.0)
        if self.cmd.top_logprobs:  # a prefill peer sends more than asked: keep what was
            self.top_logprobs.append((top or [])[:self.cmd.top_logprobs])

    def finish_reason(self) -> tuple[FinishReason, int | None] | None:
        """("stop", token) / ("length", None) when the last output token ends the request."""
        out = self.req.output_ids
        if out and out[-1] in self.stop_ids:
            return "stop", out[-1]
        if len(out) >= self.req.max_new_tokens:
            return "length", None
        return None

    def new_tokens(self) -> Tokens | None:
        """Everything produced since the last event (None when nothing is new)."""
        out = self.req.output_ids
        if self.emitted == len(out):
            return None
        start, self.emitted = self.emitted, len(out)
        ids = out[start:] if self.req.max_new_tokens else []
        lps = self.logprobs[start:len(out)] if self.cmd.return_logprob else None
        tops = self.top_logprobs[start:len(out)] if self.cmd.top_logprobs else None
        return Tokens(self.rid, OutputChunk(ids, lps, top_logprobs=tops), self.totals)

    def count_verify(self, proposed: int, accepted: int) -> None:
        """A verify step committed `accepted` of `proposed` drafts (and one more token)."""
        self.spec_verify_steps += 1
        self.spec_proposed += proposed
        self.spec_accepted += accepted

    def ended_event(self, reason: str, message: str, matched_stop: int | None) -> Ended:
        return Ended(self.rid, reason, message, matched_stop, self.totals, self.spec_counts())

    def spec_counts(self) -> SpecCounts | None:
        """Its decode forwards and drafts, when any draft was proposed for it: every decode
        step counts as a verify (a plain one of 0 drafts: one token), as in SGLang's
        `spec_verify_ct`; the first token came from the prefill."""
        if not self.spec_proposed:
            return None
        decoded = len(self.req.output_ids) - 1  # tokens from decode forwards
        plain = decoded - self.spec_verify_steps - self.spec_accepted  # one each
        return SpecCounts(self.spec_verify_steps + plain, self.spec_accepted,
                          self.spec_proposed)

    @property
    def totals(self) -> PromptTotals:
        return PromptTotals(len(self.req.prompt_ids), self.cached_tokens,
                            self.host_cached_tokens)

    @property
    def is_restoring(self) -> bool:
        """A restore still writes into this request's pages."""
        return self.restore is not None and not self.restore.is_done()
