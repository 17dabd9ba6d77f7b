"""A small blocking client of smg's gRPC worker protocol (SglangScheduler), for the tests.

`GrpcWorker(target)` runs grpc.aio on its own event loop in a background thread, so tests
call it like the HTTP helpers: `generate(request, timeout_s)` returns the responses or raises
`grpc.aio.AioRpcError` (`code()`, `details()`); `start_generate` leaves a call open (its first
response read) so a test can cancel it; `subscribe_kv` leaves SubscribeKvEvents open on the
same channel (one HTTP/2 connection, as smg's), its batches collected as they arrive.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Sequence
from typing import Any

import grpc
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc


class GrpcWorker:
    """A stub on a private loop thread; a context manager that closes the channel."""

    def __init__(self, target: str) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._channel = self.call_soon(_channel(target))
        self.stub = pb_grpc.SglangSchedulerStub(self._channel)

    def __enter__(self) -> GrpcWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.call_soon(self._channel.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()  # else its self-pipe is a ResourceWarning in whatever test GCs it

    def call_soon(self, coro: Any, timeout_s: float = 120.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    def unary(self, method: str, request: Any, timeout_s: float = 30.0,
              metadata: Sequence[tuple[str, str]] | None = None) -> Any:
        async def call() -> Any:
            return await getattr(self.stub, method)(request, timeout=timeout_s,
                                                    metadata=metadata)
        return self.call_soon(call())

    def stream(self, method: str, request: Any, timeout_s: float = 60.0,
               metadata: Sequence[tuple[str, str]] | None = None) -> list[Any]:
        async def read() -> list[Any]:
            call = getattr(self.stub, method)(request, timeout=timeout_s, metadata=metadata)
            return [r async for r in call]
        return list(self.call_soon(read(), timeout_s + 10))

    def generate(self, request: pb.GenerateRequest, timeout_s: float = 60.0,
                 metadata: Sequence[tuple[str, str]] | None = None) -> list[Any]:
        return self.stream("Generate", request, timeout_s, metadata)

    def subscribe_kv(self, start_seq: int = 0) -> KvStream:
        """SubscribeKvEvents from `start_seq` (0: a snapshot first), left open."""
        return KvStream(self, common_pb2.SubscribeKvEventsRequest(start_sequence_number=start_seq))

    def start_generate(self, request: pb.GenerateRequest) -> OpenCall:
        """A Generate call left open once its first response (or status) arrived."""
        call = self.call_soon(_open(self.stub, request))
        return OpenCall(self, call)


class KvStream:
    """An open SubscribeKvEvents call whose batches a task on the client's loop collects."""

    def __init__(self, worker: GrpcWorker, request: Any) -> None:
        self.worker = worker
        self._batches: list[Any] = []
        self.call = worker.call_soon(_open_kv(worker.stub, request))
        self.task = worker.call_soon(_collect(self.call, self._batches))

    def received(self) -> list[Any]:
        """The batches received so far (read on the client's loop, after what it has queued:
        a response read before this call is in)."""
        async def copy() -> list[Any]:
            return list(self._batches)
        return list(self.worker.call_soon(copy()))

    def wait(self, count: int, timeout_s: float = 30.0) -> list[Any]:
        """The batches once at least `count` arrived (bounded)."""
        async def until() -> list[Any]:
            while len(self._batches) < count and not self.task.done():
                await asyncio.sleep(0.01)
            return list(self._batches)
        return list(self.worker.call_soon(asyncio.wait_for(until(), timeout_s)))

    def cancel(self) -> None:
        self.worker.call_soon(_cancel(self.call))


class OpenCall:
    def __init__(self, worker: GrpcWorker, call: Any) -> None:
        self.worker, self.call = worker, call

    def cancel(self) -> None:
        self.worker.call_soon(_cancel(self.call))

    def rest(self, timeout_s: float = 60.0) -> tuple[list[Any], Any]:
        """The remaining responses and the call's final status code."""
        async def drain() -> tuple[list[Any], Any]:
            out = []
            try:
                async for r in self.call:
                    out.append(r)
            except grpc.aio.AioRpcError as exc:
                return out, exc.code()
            return out, await self.call.code()
        out, code = self.worker.call_soon(asyncio.wait_for(drain(), timeout_s))
        return out, code


async def _channel(target: str) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(target)


async def _open(stub: Any, request: pb.GenerateRequest) -> Any:
    return stub.Generate(request)


async def _open_kv(stub: Any, request: Any) -> Any:
    return stub.SubscribeKvEvents(request)


async def _collect(call: Any, into: list[Any]) -> asyncio.Task[None]:
    async def read() -> None:
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.CancelledError):
            async for batch in call:
                into.append(batch)
    return asyncio.ensure_future(read())


async def _cancel(call: Any) -> None:
    call.cancel()


def gen_request(ids: Sequence[int], max_new: int | None = 4, *, rid: str = "",
                stream: bool = False, boot: tuple[int, int] | None = None,
                **sampling: Any) -> pb.GenerateRequest:
    """A greedy Generate request (`boot`: the prefill peer's bootstrap port and the room)."""
    sp = pb.SamplingParams(**{"temperature": 0.0, **sampling})
    if max_new is not None:
        sp.max_new_tokens = max_new
    req = pb.GenerateRequest(request_id=rid, tokenized=pb.TokenizedInput(input_ids=list(ids)),
                             sampling_params=sp, stream=stream)
    if boot is not None:
        req.disaggregated_params.CopyFrom(pb.DisaggregatedParams(
            bootstrap_host="127.0.0.1", bootstrap_port=boot[0], bootstrap_room=boot[1]))
    return req


def completes(responses: list[Any]) -> list[Any]:
    return [r.complete for r in responses if r.WhichOneof("response") == "complete"]

