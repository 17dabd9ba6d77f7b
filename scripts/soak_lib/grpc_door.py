"""One gRPC `Generate` call of the soak (smg's worker protocol, `SglangScheduler`), classified
like an HTTP request (`client.Answer`) so the same tally decides whether it was answered.

Each call opens its own channel, as `client.post` opens its own connection: a channel that
met a stopped server would wait out its reconnect backoff and fail calls sent after the
restart. The classification:
- `tokens`: the call ended OK with at least one `GenerateComplete` and an output token;
- `error`: any status the server sent (INVALID_ARGUMENT, RESOURCE_EXHAUSTED, UNAVAILABLE
  while draining, ...), or OK without a token;
- `refused`: the transport's own UNAVAILABLE "failed to connect to all addresses" (the
  server was not listening);
- `dropped`: the transport broke after the call was accepted (its own messages: connection
  reset, socket closed, ...), or CANCELLED (the soak never cancels a call: the server
  cancelled it as it went away);
  a server's own UNAVAILABLE (draining, a prefill peer unreachable) is an `error` answer: the
  transport's phrases are matched at the start of the details, where a server's message
  (which may quote an errno) does not put them;
- `cut`: a call that ended OK without a `GenerateComplete` for every sample;
- `timeout`: the call's own deadline passed (the soak's request deadline: grpc core's
  DEADLINE_EXCEEDED at that time). A DEADLINE_EXCEEDED the server sent before it (the
  worker's answer to a KV transfer that timed out, `kv_timeout`) is an `error` answer.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import grpc
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from scripts.soak_lib.client import Answer

METHOD = "Generate"  # the method `decode_worker_grpc_requests_total` counts these calls under
_REFUSED = "failed to connect to all addresses"  # grpc core's text for a refused connect
_OWN_DEADLINE = "deadline exceeded"  # grpc core's text when the call's own deadline passed
_DROPPED = ("socket closed", "connection reset", "broken pipe", "goaway", "stream removed",
            "received rst_stream", "end of tcp stream", "recvmsg", "sendmsg")


def request(ids: Sequence[int], max_new: int, stream: bool,
            boot: tuple[int, int] | None = None) -> pb.GenerateRequest:
    """A greedy request of `max_new` tokens (`boot`: the prefill peer's bootstrap port and
    the room, an int32 on this protocol)."""
    sp = pb.SamplingParams(temperature=0.0, max_new_tokens=max_new, ignore_eos=True)
    req = pb.GenerateRequest(tokenized=pb.TokenizedInput(input_ids=list(ids)),
                             sampling_params=sp, stream=stream)
    if boot is not None:
        req.disaggregated_params.CopyFrom(pb.DisaggregatedParams(
            bootstrap_host="127.0.0.1", bootstrap_port=boot[0], bootstrap_room=boot[1]))
    return req


def generate(target: str, req: pb.GenerateRequest, deadline_s: float = 60.0) -> Answer:
    """Send `req` to `target` (host:port) and classify the outcome (module docstring)."""
    started = time.monotonic()
    tokens, completes = 0, 0
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.SglangSchedulerStub(channel)
        try:
            for resp in stub.Generate(req, timeout=deadline_s):
                kind = resp.WhichOneof("response")
                if kind == "chunk":
                    tokens += len(resp.chunk.token_ids)
                elif kind == "complete":
                    completes += 1
                    if not req.stream:
                        tokens += len(resp.complete.output_ids)
        except grpc.RpcError as exc:
            return _failed(exc, started, tokens, deadline_s)
    samples = max(1, req.sampling_params.n)
    if completes < samples:
        return Answer("cut", 0, f"{completes} of {samples} completes after {tokens} tokens",
                      started, tokens)
    return Answer("tokens" if tokens else "error", 0, "" if tokens else "OK without tokens",
                  started, tokens)


def _failed(exc: grpc.RpcError, started: float, tokens: int, deadline_s: float) -> Answer:
    code: grpc.StatusCode = exc.code()
    details = str(exc.details() or "")
    text = f"{code.name}: {details}"[:300]
    low = details.lower()
    if code == grpc.StatusCode.DEADLINE_EXCEEDED and (
            time.monotonic() - started >= deadline_s or low == _OWN_DEADLINE):
        return Answer("timeout", None, text, started, tokens)
    if code == grpc.StatusCode.UNAVAILABLE and low.startswith(_REFUSED) and not tokens:
        return Answer("refused", None, text, started, ended_at=time.monotonic())
    if code == grpc.StatusCode.CANCELLED or (
            code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN,
                     grpc.StatusCode.INTERNAL) and low.startswith(_DROPPED)):
        return Answer("dropped", None, text, started, tokens)
    return Answer("error", code.value[0], text, started, tokens)
