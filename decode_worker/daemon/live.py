"""What the compute thread keeps per request beside its core `DecodeRequest`."""

from __future__ import annotations

from dataclasses import dataclass, field

from decode_worker.core.request import DecodeRequest
from decode_worker.core.sampling import TopLogprobs
from decode_worker.daemon.bridge import AddRequest, TokenEvent
from decode_worker.device.sampler import SampleRow
from decode_worker.io.api.backend import FinishReason, OutputChunk


@dataclass(slots=True, eq=False)
class LiveRequest:
    """One request the engine knows: its state machine, what the client asked, its transfer.

    `transfer_id` / `aux_slot` are set while a transfer is in flight; `answered` once the client
    has had its last event (a failed transfer answers before its pages come back).
    """

    req: DecodeRequest
    cmd: AddRequest
    eos_ids: frozenset[int]
    transfer_id: int | None = None
    aux_slot: int | None = None
    cached_tokens: int = 0
    answered: bool = False
    emitted: int = 0  # output tokens already sent to the client
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[TopLogprobs] = field(default_factory=list)  # when cmd.top_logprobs

    @property
    def rid(self) -> str:
        return self.req.rid

    @property
    def has_peer(self) -> bool:
        return self.cmd.bootstrap_host is not None and self.cmd.bootstrap_room is not None

    def sample_row(self) -> SampleRow:
        return SampleRow(self.cmd.sampling, step=len(self.req.output_ids),
                         return_logprob=self.cmd.return_logprob,
                         top_logprobs=self.cmd.top_logprobs)

    def record_logprobs(self, logprob: float | None, top: TopLogprobs | None) -> None:
        """Keep the new token's logprob (and its alternatives when asked for)."""
        self.logprobs.append(logprob if logprob is not None else 0.0)
        if self.cmd.top_logprobs:  # a prefill peer sends more than asked: keep what was
            self.top_logprobs.append((top or [])[:self.cmd.top_logprobs])

    def finish_reason(self) -> tuple[FinishReason, int | None] | None:
        """("stop", token) / ("length", None) when the last output token ends the request."""
        out = self.req.output_ids
        sp = self.cmd.sampling
        if out:
            last = out[-1]
            if last in sp.stop_token_ids:
                return "stop", last
            if not sp.ignore_eos and last in self.eos_ids:
                return "stop", last
        if len(out) >= self.req.max_new_tokens:
            return "length", None
        return None

    def new_tokens_event(self, finish: tuple[FinishReason, int | None] | None) -> TokenEvent:
        """Everything produced since the last event, ending the request if `finish`."""
        out = self.req.output_ids
        start, self.emitted = self.emitted, len(out)
        ids = out[start:] if self.req.max_new_tokens else []
        lps = self.logprobs[start:len(out)] if self.cmd.return_logprob else None
        tops = self.top_logprobs[start:len(out)] if self.cmd.top_logprobs else None
        reason, matched = finish if finish is not None else (None, None)
        if finish is not None:
            self.answered = True
        return TokenEvent(self.rid, OutputChunk(
            ids, lps, reason, matched, len(self.req.prompt_ids), self.cached_tokens,
            top_logprobs=tops))

    def error_event(self, message: str, status: int, code: str) -> TokenEvent:
        self.answered = True
        return TokenEvent(self.rid, OutputChunk(
            prompt_tokens=len(self.req.prompt_ids), cached_tokens=self.cached_tokens,
            error=message, error_status=status, error_code=code))


# HTTP status a client gets for a request that ended early, by abort/failure reason
_STATUS_BY_REASON = {
    "bad_request": 400, "too_large": 413, "client_abort": 499, "queue_full": 503,
    "queue_timeout": 503, "drain": 503, "swa_reclaim_insufficient": 503,
    "transfer_failed": 502, "peer_dead": 502, "kv_timeout": 504,
}


def abort_status(reason: str) -> int:
    """The HTTP status for an early end with `reason` (500 for anything unexpected)."""
    return _STATUS_BY_REASON.get(reason, 500)
