"""The `SglangScheduler` service over the HTTP API's app: one engine path behind both doors.

`Generate` reads the request into the HTTP `/generate` body's parts (`convert.py`) and runs
the route's own steps: `check_serving` (draining: UNAVAILABLE), `check_prompt` (empty,
out-of-vocabulary ids), `max_new_tokens` (past the context), `sampling_from_generate`
(sampling values), `build_inputs` (samples, rooms), `start_all` and `merged_steps`. A
refusal is the HTTP route's error, answered with its gRPC code (`status.py`) and message; a
request that ends early ends the call with its reason's code. A call the client cancels (or
whose deadline passes) closes its runs, which aborts their requests in the backend: the
engine returns their pages, as for an HTTP client that goes away. `Abort` ends the samples of
a `request_id` the same way.

RPCs with no meaning here answer UNIMPLEMENTED with a message: `Embed` (a generation model),
the LoRA adapter calls (no adapters), `StartProfile` / `StopProfile` (no profiler hook).
`SubscribeKvEvents` streams the decode tree's KV events when the server has an event log
(the backend's `kv_events` hub, `kv_stream.py`: a decode worker with its radix cache on has one
whenever the gRPC port is, ZMQ publisher or not), else it is UNIMPLEMENTED (smg then stops
asking that worker).

API key: with `server.api_key` set (and `server.grpc_require_api_key`, the default), the
calls that serve or change work (`Generate`, `Abort`, `FlushCache`, `SubscribeKvEvents`, which
streams prompt token ids) need the metadata `authorization: Bearer <key>`, as HTTP's
generation and admin routes need the header; else UNAUTHENTICATED with a message. The reports
stay open as HTTP's /health, /server_info, /model_info and /v1/loads do: `HealthCheck`,
`GetModelInfo`, `GetServerInfo`, `GetLoads`, and `GetTokenizer` (the model's tokenizer files,
which a gateway fetches when it registers the worker).

Every call is counted in `decode_worker_grpc_requests_total{method, code}`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, NoReturn, Protocol

from grpc import StatusCode
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from decode_worker.core.sampling import check_top_logprobs
from decode_worker.errors import ClientError, DecodeWorkerError, ServiceUnavailable
from decode_worker.io.api.app import AuthError, reason_of
from decode_worker.io.api.backend import abort_label
from decode_worker.io.api.common import check_prompt, vocab_size_of
from decode_worker.io.api.context import ApiContext
from decode_worker.io.api.loads import SECTIONS
from decode_worker.io.api.run import GenerationRun, RejectedAtStart
from decode_worker.io.api.samples import Prompt, build_inputs, merged_steps, start_all
from decode_worker.io.api.schemas import sampling_from_generate
from decode_worker.io.api.targets import Target
from decode_worker.io.grpc import convert, info
from decode_worker.io.grpc.kv_stream import StreamBook, kv_batches
from decode_worker.io.grpc.status import code_for_error, code_for_reason
from decode_worker.io.kv_events.hub import KvEventHub
from decode_worker.io.metrics import Metrics

log = logging.getLogger(__name__)
Context = Any  # grpc.aio.ServicerContext (grpcio ships no type hints)


class GrpcApp(ApiContext, Protocol):
    """What the service needs of the app (`io.api.app.ApiApp`)."""

    def check_serving(self) -> None: ...

    def check_api_key(self, authorization: str | None) -> None: ...

    def server_info(self) -> dict[str, Any]: ...


class SchedulerServicer(pb_grpc.SglangSchedulerServicer):  # type: ignore[misc]
    """smg's worker service over `app`. Event loop only (grpc.aio runs the handlers there)."""

    def __init__(self, app: GrpcApp, metrics: Metrics | None = None,
                 require_key: bool = True) -> None:
        self.app = app
        self.metrics = metrics
        self.require_key = require_key
        self._calls: dict[str, list[list[str]]] = {}  # request_id -> per call, sample rids
        self._started_at = time.time()
        self._bundle: info.TokenizerBundle | None = None
        self._kv_streams = StreamBook(metrics)  # live SubscribeKvEvents streams

    # -- Generate --------------------------------------------------------------------------

    async def Generate(
        self, request: pb.GenerateRequest, context: Context
    ) -> AsyncIterator[pb.GenerateResponse]:
        outcome = StatusCode.CANCELLED  # until the call ends otherwise
        rid = request.request_id
        try:
            rids: list[str] = []  # the samples' internal rids, for Abort while they run
            self._calls.setdefault(rid, []).append(rids)
            try:
                try:
                    self._check_key(context)
                    self.app.check_serving()
                    runs = await self._start(request, rids)
                except Exception as exc:
                    outcome = code_for_error(exc)
                    log.info("rid=%s: gRPC Generate refused (%s): %s", rid, outcome.name, exc)
                    self._refuse(request, exc)
                    await _abort(context, outcome, exc)
                async for response in self._responses(request, runs):
                    yield response
            except _Ended as end:
                outcome = end.code
                log.info("rid=%s: gRPC Generate ended (%s): %s", rid, end.code.name, end)
                await _abort(context, end.code, end)
            finally:
                self._forget(rid, rids)
            outcome = StatusCode.OK
        finally:
            self._count("Generate", outcome)

    def _refuse(self, request: pb.GenerateRequest, exc: Exception) -> None:
        """A Generate refused before it started ends its room at its prefill peer at once, as
        HTTP's door refusals do (`GenerateBackend.refuse`, with the same abort label); not for
        a wrong API key nor a request the engine ended itself (`RejectedAtStart`)."""
        if isinstance(exc, AuthError | RejectedAtStart):
            return
        dp = request.disaggregated_params
        if not request.HasField("disaggregated_params") or not dp.bootstrap_host:
            return
        target = Target(dp.bootstrap_host, dp.bootstrap_port or None, dp.bootstrap_room)
        status = 503 if isinstance(exc, ServiceUnavailable) else getattr(exc, "status", 500)
        samples = max(1, request.sampling_params.n or 1)
        self.app.backend.refuse([target] * samples, abort_label(reason_of(exc), status),
                                str(exc)[:512])

    async def _start(self, request: pb.GenerateRequest, rids: list[str]) -> list[GenerationRun]:
        """The HTTP /generate route's checks and start, on the request's parts; the samples'
        rids go into `rids` before they start. Raises what they raise (ClientError,
        ServiceUnavailable, RejectedAtStart, ...)."""
        app = self.app
        sp = convert.sampling_in(request.sampling_params)
        ids = check_prompt(convert.prompt_ids(request), app.config.max_prompt_tokens,
                           vocab_size_of(app.backend.tokenizer))
        sampling = sampling_from_generate(  # up to the context when omitted, as /generate
            sp, app.max_new_tokens(len(ids), sp.max_new_tokens, default=None))
        top = check_top_logprobs(request.top_logprobs_num, "top_logprobs_num") \
            if request.return_logprob else 0
        inps = build_inputs(app, [Prompt(ids, sampling)], sp.n, convert.bootstrap(request),
                            request.request_id or None, stream=request.stream,
                            return_logprob=request.return_logprob, top_logprobs=top,
                            endpoint="grpc", received_at=time.monotonic())
        rids.extend(inp.rid for inp in inps)
        return await start_all(app, inps)

    async def _responses(self, request: pb.GenerateRequest, runs: list[GenerationRun]
                         ) -> AsyncIterator[pb.GenerateResponse]:
        """Each sample's steps as responses. Raises _Ended when a sample fails (the other
        samples are ended as `merged_steps` closes)."""
        rid = request.request_id
        async with contextlib.aclosing(merged_steps(runs)) as steps:
            async for k, step in steps:
                fin = step.finish
                if fin is not None and fin.reason == "error":
                    raise _Ended(code_for_reason(fin.code, fin.status),
                                 fin.message or "internal error")
                if fin is not None:  # the request's KV events go out first (`StreamBook`)
                    await self._kv_handed_over()
                if request.stream:
                    yield convert.chunk(rid, runs[k], step, k)
                if fin is not None:
                    yield convert.complete(rid, runs[k], k, step if request.stream else None)

    async def _kv_handed_over(self) -> None:
        """Wait (bounded) until this server's SubscribeKvEvents streams have handed over every
        KV-event batch appended so far."""
        hub = getattr(self.app.backend, "kv_events", None)
        if isinstance(hub, KvEventHub):
            await self._kv_streams.wait_sent(hub.next_seq)

    def _forget(self, rid: str, rids: list[str]) -> None:
        left = [r for r in self._calls.get(rid, []) if r is not rids]
        if left:
            self._calls[rid] = left
        else:
            self._calls.pop(rid, None)

    # -- control ---------------------------------------------------------------------------

    async def Abort(
        self, request: pb.AbortRequest, context: Context
    ) -> pb.AbortResponse:
        try:
            self._check_key(context)
        except AuthError as exc:
            self._count("Abort", StatusCode.UNAUTHENTICATED)
            await _abort(context, StatusCode.UNAUTHENTICATED, exc)
        rids = [r for call in self._calls.get(request.request_id, []) for r in call]
        for rid in rids:
            log.info("rid=%s: aborted by gRPC Abort (%s)", rid, request.reason or "-")
            self.app.backend.abort(rid, "client_abort")
        self._count("Abort", StatusCode.OK)
        found = "aborted" if rids else "not found"
        return pb.AbortResponse(success=bool(rids),
                                message=f"request {request.request_id} {found}")

    async def HealthCheck(
        self, request: pb.HealthCheckRequest, context: Context
    ) -> pb.HealthCheckResponse:
        health = self.app.backend.health()
        self._count("HealthCheck", StatusCode.OK)
        return pb.HealthCheckResponse(healthy=health.is_ok,
                                      message=health.message or health.status)

    async def FlushCache(
        self, request: common_pb2.FlushCacheRequest, context: Context
    ) -> common_pb2.FlushCacheResponse:
        """As POST /flush_cache; `timeout_s` > 0 retries a refusal (requests in flight) until
        the worker is idle or the time is up."""
        try:
            self._check_key(context)
            deadline = time.monotonic() + max(0.0, request.timeout_s)
            result = await self.app.backend.flush_cache()
            while not result.ok and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
                result = await self.app.backend.flush_cache()
        except Exception as exc:
            self._count("FlushCache", code_for_error(exc))
            await _abort(context, code_for_error(exc), exc)
        self._count("FlushCache", StatusCode.OK)
        message = result.message or (f"flushed {result.num_full_pages} full and "
                                     f"{result.num_swa_pages} swa pages")
        return common_pb2.FlushCacheResponse(success=result.ok, message=message)

    # -- reports ---------------------------------------------------------------------------

    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest, context: Context
    ) -> pb.GetModelInfoResponse:
        self._count("GetModelInfo", StatusCode.OK)
        return info.model_info(self.app.backend, self.app.model_name())

    async def GetServerInfo(
        self, request: pb.GetServerInfoRequest, context: Context
    ) -> pb.GetServerInfoResponse:
        self._count("GetServerInfo", StatusCode.OK)
        return info.server_info(self.app.server_info(), active_requests=self._num_active(),
                                started_at=self._started_at,
                                is_paused=not self.app.backend.health().is_ok)

    async def GetLoads(
        self, request: pb.GetLoadsRequest, context: Context
    ) -> pb.GetLoadsResponse:
        include = [s.strip() for s in request.include if s.strip()]
        bad = sorted(set(include) - SECTIONS)
        if request.HasField("dp_rank") and request.dp_rank != 0:
            bad_msg = f"dp_rank {request.dp_rank} does not exist: this worker has dp_rank 0"
        elif bad:
            bad_msg = f"invalid include sections: {bad}; valid options: {sorted(SECTIONS)}"
        else:
            self._count("GetLoads", StatusCode.OK)
            return info.loads(self.app.backend.load(), self.app.server_info(), include)
        self._count("GetLoads", StatusCode.INVALID_ARGUMENT)
        await _abort(context, StatusCode.INVALID_ARGUMENT, ClientError(bad_msg))

    async def GetTokenizer(
        self, request: common_pb2.GetTokenizerRequest, context: Context
    ) -> AsyncIterator[common_pb2.GetTokenizerChunk]:
        path = str(self.app.server_info().get("tokenizer_path") or "")
        if self._bundle is None or str(self._bundle.tokenizer_dir) != path:
            self._bundle = info.TokenizerBundle(Path(path))
        try:
            data, digest = await self._bundle.archive()
        except OSError as exc:
            self._count("GetTokenizer", StatusCode.FAILED_PRECONDITION)
            await _abort(context, StatusCode.FAILED_PRECONDITION, exc)
        log.info("GetTokenizer: %d bytes from %s, sha256 %s", len(data), path, digest)
        for piece in info.tokenizer_chunks(data, digest):
            yield piece
        self._count("GetTokenizer", StatusCode.OK)

    # -- not served here -------------------------------------------------------------------

    async def SubscribeKvEvents(
        self, request: common_pb2.SubscribeKvEventsRequest, context: Context
    ) -> AsyncIterator[common_pb2.KvEventBatch]:
        """The decode tree's KV events from the worker's event log (`kv_stream.py`);
        UNIMPLEMENTED where there is none (the prefill peer, events off), as SGLang's
        servicer answers without a ZMQ publisher."""
        try:
            self._check_key(context)
        except AuthError as exc:
            self._count("SubscribeKvEvents", StatusCode.UNAUTHENTICATED)
            await _abort(context, StatusCode.UNAUTHENTICATED, exc)
        hub = getattr(self.app.backend, "kv_events", None)
        if not isinstance(hub, KvEventHub):
            await self._unimplemented(
                context, "SubscribeKvEvents", "this server publishes no KV cache events (a "
                "decode worker publishes them with the decode radix cache on, unless "
                "kv_events.config says publisher \"null\")")
        log.info("SubscribeKvEvents: a subscriber from %s, start_sequence_number=%d",
                 context.peer(), request.start_sequence_number)
        outcome = StatusCode.CANCELLED
        try:
            async for batch in kv_batches(hub, request, self.app.server_info, self._kv_streams):
                yield batch
            outcome = StatusCode.OK
        finally:
            self._count("SubscribeKvEvents", outcome)

    async def Embed(self, request: Any, context: Context) -> Any:
        await self._unimplemented(context, "Embed", "this worker serves a generation model, "
                                  "not embeddings")

    async def StartProfile(self, request: Any, context: Context) -> Any:
        await self._unimplemented(context, "StartProfile", _NO_PROFILER)

    async def StopProfile(self, request: Any, context: Context) -> Any:
        await self._unimplemented(context, "StopProfile", _NO_PROFILER)

    async def LoadLoRAAdapter(self, request: Any, context: Context) -> Any:
        await self._unimplemented(context, "LoadLoRAAdapter", _NO_LORA)

    async def UnloadLoRAAdapter(self, request: Any, context: Context) -> Any:
        await self._unimplemented(context, "UnloadLoRAAdapter", _NO_LORA)

    async def ListLoadedLoRAAdapters(self, request: Any, context: Context) -> Any:
        await self._unimplemented(context, "ListLoadedLoRAAdapters", _NO_LORA)

    async def _unimplemented(self, context: Context, method: str, why: str) -> NoReturn:
        self._count(method, StatusCode.UNIMPLEMENTED)
        await _abort(context, StatusCode.UNIMPLEMENTED, DecodeWorkerError(f"{method}: {why}"))

    # -- helpers ---------------------------------------------------------------------------

    def _check_key(self, context: Context) -> None:
        """The HTTP routes' API-key check on the call's `authorization` metadata (none when
        `require_key` is off). Raises AuthError (UNAUTHENTICATED) saying what to send."""
        if not self.require_key:
            return
        metadata = {k.lower(): v for k, v in (context.invocation_metadata() or ())}
        value = metadata.get("authorization")
        try:
            self.app.check_api_key(value if isinstance(value, str) else None)
        except AuthError:
            raise AuthError(
                f"{'wrong' if value else 'missing'} API key: this worker needs gRPC metadata "
                "'authorization: Bearer <server.api_key>' (smg 1.13 sends none over gRPC: "
                "set server.grpc_require_api_key=false and fence the gRPC port)") from None

    def _num_active(self) -> int:
        return sum(len(rids) for calls in self._calls.values() for rids in calls)

    def _count(self, method: str, code: StatusCode) -> None:
        if self.metrics is not None:
            self.metrics.inc_grpc(method, code.name)


class _Ended(DecodeWorkerError):
    """A sample ended early: the call ends with `code` and this message."""

    def __init__(self, code: StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


_NO_PROFILER = "this server has no profiler hook (use py-spy or torch.profiler around it)"
_NO_LORA = "this worker serves no LoRA adapters"


async def _abort(context: Context, code: StatusCode, exc: BaseException) -> NoReturn:
    """End the call with `code` and the error's message (raises grpc.aio.AbortError)."""
    await context.abort(code, str(exc) or type(exc).__name__)
    raise AssertionError("context.abort returned")  # pragma: no cover
