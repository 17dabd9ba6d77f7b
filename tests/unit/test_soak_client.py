"""The soak's clients judge answers right: SSE lines end where the format says, a gRPC status
the server sent is an answer, and a harness failure is tallied as a loss, never lost."""

from __future__ import annotations

import json
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from scripts.soak_lib import grpc_door
from scripts.soak_lib.client import Answer, sse_lines
from scripts.soak_lib.traffic import State, Tally


def test_sse_lines_end_at_lf_only_whatever_the_chunking() -> None:
    text = "a\u2028b\x85c\u2029d"  # raw in JSON strings; `str.splitlines` would cut at each
    event = b"data: " + json.dumps({"t": text}, ensure_ascii=False).encode() + b"\r\n\r\n"
    body = event + b"data: [DONE]\n\n"
    for chunk in (1, 3, len(body)):
        resp = httpx.Response(200, content=body)
        resp.iter_bytes = lambda c=chunk, b=body: iter(  # type: ignore[method-assign]
            [b[i:i + c] for i in range(0, len(b), c)])
        lines = [ln for ln in sse_lines(resp) if ln]
        assert lines == ["data: " + json.dumps({"t": text}, ensure_ascii=False),
                         "data: [DONE]"], chunk
        assert json.loads(lines[0][6:])["t"] == text


def test_a_crashed_or_malformed_request_counts_as_unanswered() -> None:
    tally = Tally(State())
    for kind in ("crashed", "malformed", "cut", "timeout"):
        assert tally.record("traffic", "decode", Answer(kind)) == "unanswered"
    assert tally.totals()["unanswered"] == 4 and len(tally.lost) == 4


class _Scheduler(pb_grpc.SglangSchedulerServicer):  # type: ignore[misc]
    """A real gRPC server whose Generate ends with the worker's answer to a KV timeout, or
    holds the call until the client's own deadline passed."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def Generate(self, request: object, context: grpc.ServicerContext) -> object:
        if request.sampling_params.max_new_tokens == 1:  # type: ignore[attr-defined]
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                          "KV transfer failed (kv_timeout): KV did not arrive within 4.0 s")
        self.release.wait(5.0)
        return iter(())


def test_grpc_deadline_sent_by_the_server_is_an_answer_the_calls_own_is_not() -> None:
    servicer = _Scheduler()
    server = grpc.server(ThreadPoolExecutor(2))
    pb_grpc.add_SglangSchedulerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        target = f"127.0.0.1:{port}"
        sent = grpc_door.generate(target, grpc_door.request([1, 2], 1, False), deadline_s=30.0)
        assert sent.kind == "error" and "kv_timeout" in sent.detail
        own = grpc_door.generate(target, grpc_door.request([1, 2], 2, False), deadline_s=0.3)
        assert own.kind == "timeout", own
    finally:
        servicer.release.set()
        server.stop(None)
