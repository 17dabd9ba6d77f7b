"""smg's gRPC worker protocol straight against the servers, with a grpc client: every refusal
answers its status code and a message, and loses nothing.

One prefill peer and one decode worker (real processes, `--grpc-port`, small pools, a queue
of 2). Bad input is INVALID_ARGUMENT (empty prompt, ids outside the vocabulary, past the
context, bad sampling values, inputs this worker does not take); a full queue is
RESOURCE_EXHAUSTED; a draining worker is UNAVAILABLE; RPCs with no meaning here are
UNIMPLEMENTED. A cancelled call and an `Abort` end their requests in the engine. After each
part the worker is idle with its pools whole (every page back) and keeps serving; the
decode worker's counters say what happened.
"""

from __future__ import annotations

import hashlib
import io
import signal
import time
import zipfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from decode_worker.core.kv_event_index import KVEventIndex
from decode_worker.core.radix_events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
)
from decode_worker.daemon.shared.procs import PdServers, http_json
from tests.e2e.grpc_client import GrpcWorker, completes, gen_request
from tests.e2e.live_fixtures import Metrics, pool_is_whole
from tests.waiting import wait_for

pytestmark = pytest.mark.slow
CODE = grpc.StatusCode
PROMPT = list(range(20, 60))
CTX = 4096  # the tiny model's max_position_embeddings


@pytest.fixture(scope="module")
def servers(e2e_model_dir: Path) -> Iterator[PdServers]:
    common = ["--model", str(e2e_model_dir), "--set", "cache.page_size=16",
              "--set", "cache.num_full_pages=256", "--set", "cache.num_swa_pages=64",
              "--set", "scheduler.kv_timeout_s=30", "--set", "server.drain_grace_s=3"]
    with PdServers(common, grpc=True,
                   decode_args=["--set", "scheduler.max_queued_requests=2"]) as s:
        yield s


@pytest.fixture(scope="module")
def decode(servers: PdServers) -> Iterator[GrpcWorker]:
    with GrpcWorker(str(servers.decodes[0].grpc_target)) as w:
        yield w


def _metrics(servers: PdServers) -> Metrics:
    return Metrics(_text(f"{servers.decodes[0].url}/metrics"))


def _text(url: str) -> str:
    import urllib.request
    with urllib.request.urlopen(url, timeout=10) as resp:
        return str(resp.read().decode())


def _wait_idle(servers: PdServers, timeout_s: float = 30.0) -> Metrics:
    deadline = time.monotonic() + timeout_s
    while True:
        m = _metrics(servers)
        busy = sum(m.value("decode_worker_queue_requests", queue=q)
                   for q in ("prealloc", "transfer", "running"))
        if busy == 0 or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


def _waiting(servers: PdServers, count: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        load = http_json(f"{servers.decodes[0].url}/get_load", timeout_s=5)
        rows = load if isinstance(load, list) else [load]
        if sum(int(r.get("num_reqs", 0)) for r in rows) >= count:
            return
        time.sleep(0.05)
    raise AssertionError(f"{count} requests never queued on the decode worker")


def _code(worker: GrpcWorker, req: pb.GenerateRequest) -> tuple[Any, str]:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        worker.generate(req, timeout_s=30)
    return info.value.code(), str(info.value.details())


def _mm(req: pb.GenerateRequest) -> pb.GenerateRequest:
    req.mm_inputs.image_urls.append("http://127.0.0.1/x.png")
    return req


def _set(req: pb.GenerateRequest, **fields: Any) -> pb.GenerateRequest:
    for name, value in fields.items():
        setattr(req, name, value)
    return req


BAD_INPUT = [
    ("empty prompt", gen_request([]), "empty"),
    ("id outside the vocabulary", gen_request([5, 100_000]), "outside the vocabulary"),
    ("prompt fills the context", gen_request([5] * CTX), "context length"),
    ("prompt + max_new_tokens past the context", gen_request([5] * 100, CTX),
     "maximum context length"),
    ("negative temperature", gen_request(PROMPT, temperature=-1.0), "temperature"),
    ("top_p above 1", gen_request(PROMPT, top_p=1.5), "top_p"),
    ("min_p above 1", gen_request(PROMPT, min_p=2.0), "min_p"),
    ("top_k below -1", gen_request(PROMPT, top_k=-5), "top_k"),
    ("a penalty it would ignore", gen_request(PROMPT, frequency_penalty=0.5),
     "frequency_penalty"),
    ("too many samples", gen_request(PROMPT, n=1000), "at most"),
    ("json_schema that is not JSON", gen_request(PROMPT, json_schema="{"), "not valid JSON"),
    ("structural tag", gen_request(PROMPT, structural_tag="{}"), "structural_tag"),
    ("too many top logprobs", _set(gen_request(PROMPT), return_logprob=True,
                                   top_logprobs_num=10_000), "top_logprobs_num"),
    ("no tokenized input", pb.GenerateRequest(request_id="x"), "tokenized"),
    ("a LoRA adapter", _set(gen_request(PROMPT), lora_id="adapter"), "LoRA"),
    ("hidden states", _set(gen_request(PROMPT), return_hidden_states=True),
     "return_hidden_states"),
    ("an image", _mm(gen_request(PROMPT)), "multimodal"),
]


@pytest.mark.parametrize(("case", "req", "says"), BAD_INPUT, ids=[c[0] for c in BAD_INPUT])
def test_bad_input_is_invalid_argument_and_loses_nothing(
        servers: PdServers, decode: GrpcWorker, case: str, req: pb.GenerateRequest,
        says: str) -> None:
    code, details = _code(decode, req)
    assert code == CODE.INVALID_ARGUMENT, (case, code, details)
    assert says in details, (case, details)


def test_after_the_bad_input_the_worker_serves_with_every_page_back(
        servers: PdServers, decode: GrpcWorker) -> None:
    m = _wait_idle(servers)
    assert pool_is_whole(m) == []

    def refused() -> float:  # a call is counted as it ends: maybe just after its client heard
        return _metrics(servers).value("decode_worker_grpc_requests_total", method="Generate",
                                       code="INVALID_ARGUMENT")

    wait_for(lambda: refused() >= len(BAD_INPUT), 10.0, f"{len(BAD_INPUT)} refusals counted")
    out = decode.generate(gen_request(PROMPT, 4, rid="fine"))  # self-prefilled: no peer
    [done] = completes(out)
    assert done.finish_reason == "length" and len(done.output_ids) == 4


def test_unimplemented_rpcs_say_why(decode: GrpcWorker) -> None:
    for method, request in (("Embed", pb.EmbedRequest()),
                            ("StartProfile", common_pb2.StartProfileRequest()),
                            ("LoadLoRAAdapter", pb.LoadLoRAAdapterRequest(lora_name="a")),
                            ("ListLoadedLoRAAdapters", pb.ListLoadedLoRAAdaptersRequest())):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            decode.unary(method, request)
        assert info.value.code() == CODE.UNIMPLEMENTED, method
        assert method in str(info.value.details())
    with pytest.raises(grpc.aio.AioRpcError) as bad:
        decode.unary("GetLoads", pb.GetLoadsRequest(dp_rank=1))
    assert bad.value.code() == CODE.INVALID_ARGUMENT


def test_reports_and_tokenizer_bundle(servers: PdServers, decode: GrpcWorker,
                                      e2e_model_dir: Path) -> None:
    info = decode.unary("GetModelInfo", pb.GetModelInfoRequest())
    assert info.model_type == "gpt_oss" and info.architectures == ["GptOssForCausalLM"]
    assert info.max_context_length == CTX and info.vocab_size > 0 and info.eos_token_ids
    server = decode.unary("GetServerInfo", pb.GetServerInfoRequest())
    assert server.server_args["disaggregation_mode"] == "decode"
    assert server.server_type == "grpc"
    assert decode.unary("HealthCheck", pb.HealthCheckRequest()).healthy
    loads = decode.unary("GetLoads", pb.GetLoadsRequest(include=["core", "disagg"]))
    assert loads.dp_rank_count == 1 and loads.loads[0].disaggregation.mode == "decode"
    chunks = decode.stream("GetTokenizer", common_pb2.GetTokenizerRequest())
    data = b"".join(c.data for c in chunks)
    assert chunks[-1].sha256 == hashlib.sha256(data).hexdigest()
    assert all(not c.sha256 for c in chunks[:-1])
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        assert zf.read("tokenizer.json") == (e2e_model_dir / "tokenizer.json").read_bytes()


def test_full_queue_is_resource_exhausted_and_cancel_returns_the_pages(
        servers: PdServers, decode: GrpcWorker) -> None:
    """Two calls wait for KV the prefill peer never sends (it never hears of their rooms over
    its own door); the third finds the queue full. Cancelling the two (the client goes away)
    and an `Abort` end them in the engine."""
    before = _metrics(servers).value("decode_worker_aborts_total", reason="client_abort")
    boot = servers.boot_port
    first = decode.start_generate(gen_request(PROMPT, 4, rid="wait-1", boot=(boot, 11)))
    second = decode.start_generate(gen_request(PROMPT, 4, rid="wait-2", boot=(boot, 12)))
    _waiting(servers, 2)
    code, details = _code(decode, gen_request(PROMPT, 4, boot=(boot, 13)))
    assert code == CODE.RESOURCE_EXHAUSTED and "queue full" in details
    first.cancel()
    aborted = decode.unary("Abort", pb.AbortRequest(request_id="wait-2", reason="test"))
    assert aborted.success
    assert second.rest()[1] == CODE.CANCELLED
    assert not decode.unary("Abort", pb.AbortRequest(request_id="nobody")).success
    m = _wait_idle(servers)
    assert pool_is_whole(m) == []
    deadline = time.monotonic() + 10
    while m.value("decode_worker_aborts_total", reason="client_abort") < before + 2:
        assert time.monotonic() < deadline, "the cancelled calls were not aborted"
        time.sleep(0.1)
        m = _metrics(servers)
    assert m.value("decode_worker_grpc_requests_total", method="Generate",
                   code="RESOURCE_EXHAUSTED") == 1


def test_a_refused_generate_ends_its_room_at_the_prefill_peer_at_once(
        servers: PdServers, decode: GrpcWorker) -> None:
    """A Generate refused with INVALID_ARGUMENT that names a room (DisaggregatedParams) ends
    that room at its prefill peer at once, as HTTP's door refusals do: the router's copy of the
    request there is answered with the refusal's reason long before `kv_timeout_s` (30 s), and
    the decode worker counts the refusal."""
    room = 77_000_001
    before = _metrics(servers).value("decode_worker_aborts_total", reason="bad_request")
    req = gen_request(PROMPT, temperature=-1.0)
    req.disaggregated_params.bootstrap_host = "127.0.0.1"
    req.disaggregated_params.bootstrap_port = servers.boot_port
    req.disaggregated_params.bootstrap_room = room
    code, _ = _code(decode, req)
    assert code == CODE.INVALID_ARGUMENT
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4},
            "bootstrap_host": "127.0.0.1", "bootstrap_port": servers.boot_port,
            "bootstrap_room": room}
    started = time.monotonic()
    resp = httpx.post(f"{servers.prefill.url}/generate", json=body, timeout=40)
    assert resp.status_code != 200 and "bad_request" in resp.text, resp.text[:500]
    assert time.monotonic() - started < 5.0
    after = _metrics(servers).value("decode_worker_aborts_total", reason="bad_request")
    assert after == before + 1


def test_kv_events_stream_over_grpc_without_a_zmq_publisher(
        servers: PdServers, decode: GrpcWorker) -> None:
    """No `--kv-events-config`, the gRPC port on: SubscribeKvEvents streams the decode tree's
    events from the in-process log (a snapshot first, then each step's batch); no socket, so
    /server_info reports no `kv_events` publisher. The prefill peer has no tree: UNIMPLEMENTED."""
    assert http_json(f"{servers.decodes[0].url}/server_info")["kv_events"] is None
    first, second = [7, *PROMPT, 7], [8, *PROMPT, 8]
    assert completes(decode.generate(gen_request(first, 4, rid="kv-1")))[0].finish_reason
    stream = decode.subscribe_kv()
    try:
        [snap] = stream.wait(1)
        assert snap.HasField("snapshot") and snap.events[0].HasField("cleared")
        assert completes(decode.generate(gen_request(second, 4, rid="kv-2")))[0].finish_reason
        batches = stream.wait(2)
        assert not batches[-1].HasField("snapshot")  # a live batch
        index = KVEventIndex()
        index.apply(proto_events(batches))
        for prompt in (first, second):
            assert index.match_len(prompt) == len(prompt) // 16 * 16 > 0
    finally:
        stream.cancel()
    with GrpcWorker(str(servers.prefill.grpc_target)) as prefill, \
            pytest.raises(grpc.aio.AioRpcError) as info:
        prefill.stream("SubscribeKvEvents", common_pb2.SubscribeKvEventsRequest(), 10)
    assert info.value.code() == CODE.UNIMPLEMENTED
    assert _metrics(servers).value("decode_worker_grpc_requests_total",
                                   method="SubscribeKvEvents", code="UNIMPLEMENTED") == 0


def test_events_on_the_channel_before_each_answer_predict_the_next_turn(
        servers: PdServers, decode: GrpcWorker) -> None:
    """smg's view of a worker: SubscribeKvEvents and Generate on one channel. Each later turn
    goes out the moment the previous answer came, predicted from the batches received by then
    (nothing waited for): every `cached_tokens` matches. Answers end on stop tokens (their
    pages still wait for a launched step under overlap), stop strings (found by the API, which
    tells the engine) and by length; the worker hands a request's batches to the stream before
    its answer, and one connection keeps that order."""
    stream = decode.subscribe_kv()
    stops: list[dict[str, Any]] = [{"stop_token_ids": list(range(100, 130))},
                                   {"stop": list("defghijklmnopqrstuvwxyz")}, {}]
    ends, grown = Counter[str](), 0
    try:
        decode.generate(gen_request([9, *PROMPT], 2, rid="turn-warm-up"))
        stream.wait(1)  # a snapshot or that batch: the subscription holds from here on
        for i in range(3):
            history = last = [(i * 31 + j) % 200 + 3 for j in range(150)]
            for t in range(4):
                prompt = history + [(i + t * 7 + j) % 50 + 60 for j in range(40)]
                index = KVEventIndex()  # what a router holds: the stream so far
                index.apply(proto_events(stream.received()))
                predicted = index.match_len_across(prompt)
                out = decode.generate(gen_request(prompt, 24, rid=f"turn-{i}-{t}",
                                                  **stops[t % 3]))
                [done] = completes(out)
                assert done.cached_tokens == predicted, (i, t, done.finish_reason)
                grown += t > 0 and predicted > len(last) - len(last) % 16
                ends[done.finish_reason if done.finish_reason != "stop" else
                     "stop string" if done.matched_stop_str else "stop token"] += 1
                last, history = prompt, prompt + list(done.output_ids)
    finally:
        stream.cancel()
    assert ends["stop token"] and ends["stop string"] and grown, (ends, grown)
    lag = _metrics(servers).value("decode_worker_kv_event_lag_seconds_count", transport="grpc")
    assert lag > 0


def proto_events(batches: list[Any]) -> list[KVEvent]:
    """smg-grpc-proto batches as the tree's events (a snapshot's first chunk clears)."""
    out: list[KVEvent] = []
    for batch in batches:
        for event in batch.events:
            kind = event.WhichOneof("data")
            if kind == "cleared":
                out.append(AllBlocksCleared())
            elif kind == "removed":
                out.append(BlockRemoved(list(event.removed.block_hashes),
                                        event.removed.medium or MEDIUM_GPU))
            else:
                st = event.stored
                parent = st.parent_block_hash if st.HasField("parent_block_hash") else None
                out.append(BlockStored([b.block_hash for b in st.blocks], parent,
                                       [tok for b in st.blocks for tok in b.token_ids],
                                       st.blocks[0].block_size, st.medium or MEDIUM_GPU))
    return out


def test_draining_worker_is_unavailable(servers: PdServers, decode: GrpcWorker) -> None:
    """Last in this module: SIGTERM the decode worker while a call waits for KV. New calls get
    UNAVAILABLE, HealthCheck says it drains, and the waiting call ends (drain)."""
    waiting = decode.start_generate(
        gen_request(PROMPT, 4, rid="at-drain", boot=(servers.boot_port, 21)))
    _waiting(servers, 1)
    proc = servers.decodes[0].proc
    assert proc is not None
    proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    while decode.unary("HealthCheck", pb.HealthCheckRequest()).healthy:
        assert time.monotonic() < deadline, "the worker never said it drains"
        time.sleep(0.05)
    code, details = _code(decode, gen_request(PROMPT, 4, boot=(servers.boot_port, 22)))
    assert code == CODE.UNAVAILABLE and "drain" in details
    assert waiting.rest(timeout_s=30)[1] == CODE.UNAVAILABLE
    assert proc.wait(30) == 0


