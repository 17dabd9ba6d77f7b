"""The prefill peer behind the HTTP API: `POST /generate` (and the OpenAI routes) with a
`bootstrap_room` hand the prompt to `PrefillPeer`; the reply comes once the KV is handed off.

The router sends the same body to prefill and decode; the prefill reply carries the first
token only (`finish_reason` "length") and, as `cached_tokens`, the prompt tokens the decode
worker already held (the transfer skipped them); the decode worker streams the rest. A request
without `bootstrap_room` is a client error here: this node only prefills for a decode worker.
/get_load counts the requests whose reply is pending; /flush_cache succeeds with nothing to do
(the peer keeps no prefix cache), as SGLang answers for a server without a radix cache.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from decode_worker.core.sampling import SamplingParams
from decode_worker.daemon.prefill.state import PrefillResult
from decode_worker.device.grammar import prepare_sampling
from decode_worker.device.tokenizer import Tokenizer
from decode_worker.errors import ClientError
from decode_worker.io.api.backend import FlushResult, GenerateInput, Health, Load, OutputChunk
from decode_worker.io.api.targets import Target
from decode_worker.io.metrics import Metrics
from decode_worker.settings import TransferSettings

log = logging.getLogger(__name__)


class PromptPeer(Protocol):
    """What the backend needs of a prefill peer (`PrefillPeer`, `SglangPrefillPeer`)."""

    @property
    def settings(self) -> TransferSettings: ...

    @property
    def bootstrap_port(self) -> int:
        """The bound bootstrap port (`transfer.bootstrap_port`, or the free one for 0)."""
        ...

    def add_prompt(self, room: int, token_ids: list[int],
                   on_done: Callable[[PrefillResult], None] | None = None,
                   sampling: SamplingParams | None = None) -> None: ...


class PrefillBackend:
    """`GenerateBackend` of the prefill peer. Event-loop side only; never blocks the loop."""

    def __init__(self, peer: PromptPeer, model_dir: Path, wait_s: float, *,
                 context_length: int | None = None, metrics: Metrics | None = None) -> None:
        """`context_length`: the model's max_position_embeddings (the API layer checks requests
        against it); `metrics`: where each request's outcome is counted."""
        self.peer = peer
        self.model_dir = model_dir
        self.wait_s = wait_s
        self.context_length = context_length
        self.metrics = metrics
        self._tokenizer = Tokenizer.from_dir(model_dir)
        self._pending_tokens: dict[str, int] = {}  # rid -> prompt tokens, until its reply

    @property
    def tokenizer(self) -> Tokenizer:
        return self._tokenizer

    def generate(self, inp: GenerateInput) -> AsyncIterator[OutputChunk]:
        """Raises ClientError (400) without `bootstrap_room`."""
        if inp.bootstrap_room is None:
            raise ClientError("the prefill peer serves only P/D requests: bootstrap_room missing")
        # a grammar is compiled here (cached; the first token must obey it): a bad one is a 400
        inp.sampling = prepare_sampling(self._tokenizer, inp.sampling)
        loop = asyncio.get_running_loop()
        done: asyncio.Future[PrefillResult] = loop.create_future()

        def _on_done(result: PrefillResult) -> None:  # compute thread
            loop.call_soon_threadsafe(_settle, done, result)

        self.peer.add_prompt(inp.bootstrap_room, list(inp.input_ids), _on_done, inp.sampling)
        return self._reply(inp, done)

    async def _reply(
        self, inp: GenerateInput, done: asyncio.Future[PrefillResult]
    ) -> AsyncIterator[OutputChunk]:
        n = len(inp.input_ids)
        self._pending_tokens[inp.rid] = n
        try:
            result = await asyncio.wait_for(done, self.wait_s)
        except TimeoutError:
            self._count("kv_timeout")
            yield OutputChunk(prompt_tokens=n, error="no transfer request for this room in time",
                              error_code="kv_timeout")  # fmt: skip
            return
        finally:
            self._pending_tokens.pop(inp.rid, None)
        if result.error is not None or result.token_id is None:
            code = result.error_code or "transfer_failed"  # else: the decode side's reason
            self._count(code)
            yield OutputChunk(prompt_tokens=n, error=result.error or "prefill failed",
                              error_code=code)  # fmt: skip
            return
        self._count("finished")
        if self.metrics is not None:  # the transfer this request fed
            self.metrics.observe_push(result.num_bytes)
        logprobs = [result.logprob] if inp.return_logprob else None
        top = [result.top_logprobs[:inp.top_logprobs]] if inp.top_logprobs else None
        yield OutputChunk(token_ids=[result.token_id], logprobs=logprobs,
                          finish_reason="length", prompt_tokens=n, top_logprobs=top,
                          cached_tokens=result.reused_tokens)

    def _count(self, outcome: str) -> None:
        """decode_worker_requests_total{status}: finished; aborted (kv_timeout: no transfer
        request came for the room); failed (transfer_failed, also a transfer failure)."""
        if self.metrics is None:
            return
        if outcome == "transfer_failed":
            self.metrics.inc_request("failed")
            self.metrics.inc_transfer_failure(outcome)
        elif outcome == "finished":
            self.metrics.inc_request(outcome)
        else:  # kv_timeout, or the reason the decode side ended the request for
            self.metrics.inc_abort(outcome)

    def abort(self, rid: str, reason: str) -> None:
        """Nothing to stop: the KV push runs to completion (the decode side owns aborts)."""
        log.info("rid=%s: client went away (%s); the push continues", rid, reason)

    def finish(self, rid: str) -> None:
        return None

    def refuse(self, targets: Sequence[Target], reason: str, message: str) -> None:
        """Counted (`decode_worker_aborts_total{reason}`); nobody to tell: the decode side
        learns of it from its own copy of the request or its transfer."""
        if self.metrics is not None:
            for _ in range(max(1, len(targets))):
                self.metrics.inc_abort(reason)

    def health(self) -> Health:
        return Health()

    def load(self) -> Load:
        """Every pending request counts as running: the peer does not tell waiting from
        prefilling on this side."""
        return Load(num_running_reqs=len(self._pending_tokens),
                    num_tokens=sum(self._pending_tokens.values()), measured_at=time.perf_counter())

    async def flush_cache(self) -> FlushResult:
        log.info("cache flush: the prefill peer keeps no prefix cache, nothing to flush")
        return FlushResult(True)

    def server_info(self) -> dict[str, Any]:
        """The API layer adds `served_model_name`. The peer keeps no prefix cache."""
        return {"model_path": str(self.model_dir), "tokenizer_path": str(self.model_dir),
                "tp_size": 1, "dp_size": 1, "disaggregation_mode": "prefill",
                "disaggregation_transfer_backend": "nixl",
                "disaggregation_bootstrap_port": self.peer.bootstrap_port,
                "context_length": self.context_length, "disable_radix_cache": True,
                "disaggregation_decode_enable_radix_cache": False,
                "enable_unified_radix_tree": False}  # fmt: skip

    def model_info(self) -> dict[str, Any]:
        return {"model_path": str(self.model_dir), "tokenizer_path": str(self.model_dir),
                "is_generation": True, "context_length": self.context_length}  # fmt: skip


def _settle(fut: asyncio.Future[PrefillResult], result: PrefillResult) -> None:
    if not fut.done():
        fut.set_result(result)
