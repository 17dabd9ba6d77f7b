"""Capture golden wire frames of SGLang 0.5.23's NIXL PD protocol (venv-only).

    .venv-sglang/bin/python tests/interop/sglang_prefill/capture_frames.py [--out DIR]

Runs prefill_server.py (SGLang's prefill classes) and SGLang's own decode side in this process
(decode_side.py), records every ZMQ multipart message this process sends or receives (pyzmq's
`send_multipart` / `recv_multipart` wrapped at class level), and the bootstrap server's HTTP
answers, and writes them to tests/data/sglang_frames/ as `<name>.frames.json` and
`<name>.http.json`. Each file carries the inputs used and SGLang's own decoding of the message
(`KVArgsRegisterInfo.from_zmq`, `TransferInfo.from_zmq`, ...), so a main-env unit test can check
its encoder/decoder against both. README.md in that directory describes the files.
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import sglang_cpu
from layout import Layout

sglang_cpu.prepare_env()

import launch  # noqa: E402
import numpy as np  # noqa: E402
import zmq  # noqa: E402
from decode_side import DecodeSide, Receipt  # noqa: E402

OUT = Path(__file__).resolve().parents[2] / "data" / "sglang_frames"
GUARD = b"NixlMsgGuard"
_lock = threading.Lock()
_log: list[tuple[str, list[bytes]]] = []  # (direction, frames)


def _record_zmq() -> None:
    real_send, real_recv = zmq.Socket.send_multipart, zmq.Socket.recv_multipart

    def send_multipart(self: Any, msg_parts: Any, *args: Any, **kwargs: Any) -> Any:
        with _lock:
            _log.append(("sent", [bytes(p) for p in msg_parts]))
        return real_send(self, msg_parts, *args, **kwargs)

    def recv_multipart(self: Any, *args: Any, **kwargs: Any) -> Any:
        parts = real_recv(self, *args, **kwargs)
        with _lock:
            _log.append(("received", [bytes(p) for p in parts]))
        return parts

    zmq.Socket.send_multipart = send_multipart
    zmq.Socket.recv_multipart = recv_multipart


def _find(direction: str, want: Any, timeout_s: float = 10.0, count: int = 1) -> Any:
    """The first (`count` = 1) or first `count` recorded messages in `direction` matching."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with _lock:
            found = [frames for d, frames in _log if d == direction and want(frames)]
        if len(found) >= count:
            return found[0] if count == 1 else found[:count]
        time.sleep(0.01)
    raise TimeoutError(f"no {count} {direction} message(s) matched")


def _jsonable(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        value = dataclasses.asdict(value)  # type: ignore[arg-type]
    if hasattr(value, "__struct_fields__"):
        value = {f: getattr(value, f) for f in value.__struct_fields__}
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, bytes):
        return {"bytes_len": len(value)}
    if isinstance(value, np.integer):
        return int(value)
    return value


class Writer:
    def __init__(self, out: Path, common: dict[str, Any]) -> None:
        self.out, self.common, self.names = out, common, []
        out.mkdir(parents=True, exist_ok=True)

    def frames(self, name: str, frames: list[bytes], *, direction: str, description: str,
               inputs: dict[str, Any], decoded: Any, notes: dict[int, str],
               opaque: tuple[int, ...] = (), unstable: tuple[int, ...] = ()) -> None:
        doc = {"name": name, "kind": "zmq-multipart", "direction": direction,
               "description": description, **self.common, "inputs": inputs,
               "frames": [base64.b64encode(f).decode() for f in frames],
               "frame_notes": {str(i): n for i, n in sorted(notes.items())},
               "opaque": list(opaque), "unstable": list(unstable),
               "sglang_decoded": _jsonable(decoded)}
        self._write(f"{name}.frames.json", doc)

    def http(self, name: str, *, method: str, url: str, status: int, body: Any,
             description: str, request_json: Any = None, unstable: tuple[str, ...] = ()) -> None:
        doc = {"name": name, "kind": "http", "description": description, **self.common,
               "method": method, "path": url,
               "request_json": request_json, "status": status, "body": body,
               "unstable": list(unstable)}
        self._write(f"{name}.http.json", doc)

    def _write(self, filename: str, doc: dict[str, Any]) -> None:
        (self.out / filename).write_text(json.dumps(doc, indent=1) + "\n")
        self.names.append(filename)


REGISTER_NOTES = {
    0: "GUARD b'NixlMsgGuard'", 1: "b'None': a registration", 2: "decode ip",
    3: "decode PULL port", 4: "decode NIXL agent name", 5: "decode NIXL agent metadata",
    6: "KV base pointers u64, [K full layers..., V full layers...]",
    7: "aux buffer base pointers u64 (10 buffers)",
    8: "state pointers pack_int_lists([[SWA K..., SWA V...]], 'Q')", 9: "gpu_id",
    10: "decode attn_tp_size", 11: "decode tp rank", 12: "dst_kv_item_len (first entry)",
    13: "state item lens pack_int_lists(.., 'I')",
    14: "state dim per tensor pack_int_lists([[]], 'I'): one component, no entries",
    15: "staging base ptr (empty)", 16: "staging size (empty)", 17: "dst_num_slots",
    18: "KV memory kinds", 19: "KV item lens u64",
    20: "state layer ids pack_int_lists([[]], 'I'): one component, no entries",
    21: "KV layer ids (empty: positional pairing)", 22: "dcp size", 23: "dcp rank",
    24: "state data lens pack_int_lists(.., 'Q')",
}
TRANSFER_NOTES = {
    0: "GUARD", 1: "room", 2: "decode ip", 3: "decode PULL port", 4: "decode agent name",
    5: "destination KV page ids, int32 LE", 6: "aux row index", 7: "required_dst_info_num",
    8: "state indices pack_int_lists([swa pages], 'i')", 9: "decode_prefix_len", 10: "is_dummy",
}


def _inputs(receipt: Receipt, page_size: int) -> dict[str, Any]:
    return {"room": receipt.room, "seq_len": receipt.seq_len,
            "decode_prefix_len": receipt.prefix_len, "aux_row": receipt.row,
            "decode_kv_pages": receipt.full_pages[receipt.prefix_len // page_size:],
            "decode_swa_window_start": receipt.swa_start, "decode_swa_pages": receipt.swa_pages}


def capture(writer: Writer, decode: DecodeSide, ctl: int, bport: int) -> None:
    from sglang.srt.disaggregation.common.conn import AbortAck, AbortNotification
    from sglang.srt.disaggregation.nixl.conn import KVArgsRegisterInfo, TransferInfo

    is_ti = lambda room: lambda f: f[:2] == [GUARD, str(room).encode()]  # noqa: E731
    is_status = lambda room: lambda f: f[:2] == [b"KV_STATUS", str(room).encode()]  # noqa: E731
    mgr, ps = decode.manager, decode.layout.page_size

    # 1. first room: registration, TransferInfo without a decode prefix, KV_STATUS Success
    r1 = decode.receive(2001, 40)
    reg = _find("sent", lambda f: f[:2] == [GUARD, b"None"])
    prefill = {"room": 2001, "input_ids": list(range(100, 140)), "first_token": 11,
               "logprob": -0.25, "top_logprobs": [[11, -0.25], [12, -2.0]], "wait_s": 30}
    launch.post(ctl, "/prefill", prefill)
    decode.wait(r1, 30)
    assert r1.status == "success", r1.reason
    info = KVArgsRegisterInfo.from_zmq(reg[1:])
    kv_ptrs = decode.kv_args.kv_data_ptrs
    writer.frames(
        "register", reg, direction="decode->prefill",
        description="KVArgsRegisterInfo: NixlKVReceiver's first contact with a prefill rank "
                    "(NixlKVManager.build_receiver_registration_message), on ZMQ PUSH to the "
                    "rank's PULL",
        inputs={"decode_kv_data_ptrs": kv_ptrs, "decode_kv_item_lens": decode.kv_args.kv_item_lens,
                "decode_state_item_lens": decode.kv_args.state_item_lens,
                "decode_aux_item_lens": decode.kv_args.aux_item_lens},
        decoded=dataclasses.replace(info, agent_metadata=b""), notes=REGISTER_NOTES,
        opaque=(5,), unstable=(2, 3, 4, 5, 6, 7, 8))
    ti1 = _find("sent", is_ti(2001))
    writer.frames("transfer_info", ti1, direction="decode->prefill",
                  description="TransferInfo for one room, no decode radix hit "
                              "(decode_prefix_len 0)", inputs=_inputs(r1, ps),
                  decoded=TransferInfo.from_zmq(ti1[1:]), notes=TRANSFER_NOTES,
                  unstable=(2, 3, 4))
    ok = _find("received", is_status(2001))
    writer.frames("kv_status_success", ok, direction="prefill->decode",
                  description="KV_STATUS Success (4) after every NIXL handle of the room is done",
                  inputs={"room": 2001, "prefill_request": prefill,
                          "aux_row_landed": decode.aux_row(r1)},
                  decoded=mgr.parse_kv_status_message(ok),
                  notes={0: "tag", 1: "room", 2: "status (4 = Success)",
                         3: "prefill rank (attn_tp_rank*pp*cp + pp_rank*cp + cp_rank)",
                         4: "reason (empty)"})
    decode.release(r1)

    # 2. TransferInfo with a decode radix hit
    r2 = decode.receive(2002, 100, prefix_len=32)
    launch.post(ctl, "/prefill", {"room": 2002, "input_ids": list(range(100)), "wait_s": 30})
    decode.wait(r2, 30)
    assert r2.status == "success", r2.reason
    ti2 = _find("sent", is_ti(2002))
    writer.frames("transfer_info_decode_prefix", ti2, direction="decode->prefill",
                  description="TransferInfo with decode_prefix_len 32: only the page ids of "
                              "[32, L) in frame 5, SWA window from floor_ps(max(32, L-127))",
                  inputs=_inputs(r2, ps), decoded=TransferInfo.from_zmq(ti2[1:]),
                  notes=TRANSFER_NOTES, unstable=(2, 3, 4))
    decode.release(r2)

    # 3./4. failures the prefill reports
    for room, fail, name, why in (
            (2003, {"fail": "status", "fail_reason": "synthetic prefill failure"},
             "kv_status_failed", "a failure the prefill concludes (conclude_failure, as its "
             "transfer worker does on a transport error) with its reason"),
            (2004, {"fail": "state_mismatch"}, "kv_status_failed_state_mismatch",
             "the prefill's transfer worker rejecting a SWA page count that differs from the "
             "decode's (prefill sent one page more)")):
        r = decode.receive(room, 60)
        launch.post(ctl, "/prefill", {"room": room, "input_ids": list(range(60)), **fail,
                                      "wait_s": 30})
        decode.wait(r, 30)
        assert r.status == "failed", (room, r.status, r.reason)
        msg = _find("received", is_status(room))
        writer.frames(name, msg, direction="prefill->decode",
                      description=f"KV_STATUS Failed (0): {why}",
                      inputs={"room": room, "seq_len": 60, **fail},
                      decoded=mgr.parse_kv_status_message(msg),
                      notes={0: "tag", 1: "room", 2: "status (0 = Failed)", 3: "prefill rank",
                             4: "reason, utf-8"})
        decode.release(r)

    # 5. decode-side abort while the prefill is still "computing": ABORT and ABORT_ACK
    r5 = decode.receive(2005, 60)
    launch.post(ctl, "/prefill", {"room": 2005, "input_ids": list(range(60)), "delay_s": 1.0})
    _wait_prefill_status(ctl, 2005, "waiting_for_input")
    r5.receiver.abort()
    abort = _find("sent", lambda f: f[:2] == [b"ABORT", b"2005"])
    ack = _find("received", lambda f: f[:2] == [b"ABORT_ACK", b"2005"])
    prefill_state = _wait_prefill_status(ctl, 2005, "failed")
    writer.frames("abort", abort, direction="decode->prefill",
                  description="ABORT from NixlKVReceiver.abort() after send_metadata (deferred "
                              "KV release armed: decode ip/port and generation present)",
                  inputs={"room": 2005, "seq_len": 60}, decoded=AbortNotification.from_zmq(abort),
                  notes={0: "tag", 1: "room", 2: "decode ip", 3: "decode PULL port",
                         4: "generation (per decode manager, counts up from 1)"},
                  unstable=(2, 3))
    writer.frames("abort_ack", ack, direction="prefill->decode",
                  description="ABORT_ACK once the room's queued/in-flight chunks drained (none "
                              "were: the prefill was still computing)",
                  inputs={"room": 2005, "prefill_room_state": prefill_state},
                  decoded=AbortAck.from_zmq(ack),
                  notes={0: "tag", 1: "room", 2: "prefill rank", 3: "generation echoed"})
    decode.release(r5)
    _capture_http(writer, bport)


def capture_tp(writer: Writer, decode: DecodeSide, ctl: int, bport: int, tp: int) -> None:
    """Prefill attention TP `tp` -> decode TP 1: one TransferInfo and one KV_STATUS per rank."""
    from sglang.srt.disaggregation.nixl.conn import TransferInfo

    r = decode.receive(2101, 40)
    launch.post(ctl, "/prefill", {"room": 2101, "input_ids": list(range(40)),
                                  "first_token": 3, "wait_s": 30})
    decode.wait(r, 30)
    assert r.status == "success", r.reason
    infos = _find("sent", lambda f: f[:2] == [GUARD, b"2101"], count=tp)
    writer.frames(f"tp{tp}_transfer_info", infos[0], direction="decode->prefill",
                  description=f"TransferInfo to each of the {tp} prefill ranks (identical "
                              "messages; required_dst_info_num 1: each rank needs one decode)",
                  inputs=_inputs(r, decode.layout.page_size),
                  decoded=TransferInfo.from_zmq(infos[0][1:]), notes=TRANSFER_NOTES,
                  unstable=(2, 3, 4))
    statuses = _find("received", lambda f: f[:2] == [b"KV_STATUS", b"2101"], count=tp)
    for msg in sorted(statuses, key=lambda f: int(f[3])):
        writer.frames(f"tp{tp}_kv_status_success_rank{int(msg[3])}", msg,
                      direction="prefill->decode",
                      description=f"KV_STATUS Success from prefill rank {int(msg[3])} of {tp}: "
                                  "the decode counts distinct ranks up to "
                                  "required_prefill_response_num",
                      inputs={"room": 2101, "seq_len": 40, "prefill_tp": tp},
                      decoded=decode.manager.parse_kv_status_message(msg),
                      notes={0: "tag", 1: "room", 2: "status", 3: "prefill rank", 4: "reason"})
    decode.release(r)
    import requests

    for name, path in (("route_server_info", _route(-1, -1, -1, -1)),
                       ("route_rank1", _route(0, 0, 1, 0))):
        resp = requests.get(f"http://127.0.0.1:{bport}{path}", timeout=5)
        writer.http(f"tp{tp}_{name}", method="GET", url=path, status=resp.status_code,
                    body=resp.json(), description=f"prefill with attention TP {tp}",
                    unstable=("rank_port",))


def _route(dp: int, cp: int, tp: int, pp: int) -> str:
    return (f"/route?prefill_dp_rank={dp}&prefill_cp_rank={cp}&target_tp_rank={tp}"
            f"&target_pp_rank={pp}")


def _wait_prefill_status(ctl: int, room: int, status: str, timeout_s: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = launch.get(ctl, f"/rooms/{room}")
        if state.get("status") == status:
            return state
        time.sleep(0.02)
    raise TimeoutError(f"prefill room {room} never reached {status}")


def _capture_http(writer: Writer, bport: int) -> None:
    import requests
    from sglang.srt.disaggregation.nixl.conn import NixlKVBootstrapServer

    def answer(port: int, path: str) -> tuple[int, Any]:
        resp = requests.get(f"http://127.0.0.1:{port}{path}", timeout=5)
        is_json = resp.headers.get("Content-Type", "").startswith("application/json")
        return resp.status_code, resp.json() if is_json else resp.text

    for name, path, what, unstable in (
            ("route_server_info", _route(-1, -1, -1, -1),
             "PrefillServerInfo, once every rank registered", ()),
            ("route_rank", _route(0, 0, 0, 0), "one rank's ZMQ PULL address",
             ("rank_port",)),
            ("route_unknown_rank", _route(0, 0, 7, 0), "a rank that does not exist", ()),
            ("route_missing_query", "/route?prefill_dp_rank=0", "a query without every key",
             ()),
            ("health", "/health", "the decode's heartbeat target", ())):
        status, body = answer(bport, path)
        writer.http(name, method="GET", url=path, status=status, body=body, description=what,
                    unstable=unstable)
    idle_port = bport + 3
    NixlKVBootstrapServer(host="127.0.0.1", port=idle_port)
    time.sleep(0.5)
    status, body = answer(idle_port, _route(-1, -1, -1, -1))
    writer.http("route_not_ready", method="GET", url=_route(-1, -1, -1, -1), status=status,
                body=body, description="a bootstrap server no rank has registered with yet")
    puts = [json.loads(line) for line in
            Path(os.environ["SGLANG_CPU_RECORD_ROUTE_PUT"]).read_text().splitlines()]
    writer.http("route_put", method="PUT", url="/route", status=puts[0]["status"],
                body=puts[0]["text"], request_json=puts[0]["json"],
                description="what a prefill rank registers with its bootstrap server",
                unstable=("rank_port",))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--bootstrap-port", type=int, default=18220)
    parser.add_argument("--control-port", type=int, default=18221)
    parser.add_argument("--decode-port", type=int, default=18222)
    parser.add_argument("--tp-size", type=int, default=1,
                        help="prefill attention TP; >1 writes only the tp<N>_* files")
    args = parser.parse_args()
    layout = Layout()
    put_log = args.out / ".route_put.jsonl"
    args.out.mkdir(parents=True, exist_ok=True)
    put_log.unlink(missing_ok=True)
    os.environ["SGLANG_CPU_RECORD_ROUTE_PUT"] = str(put_log)
    server, _ready = launch.start_prefill_server(args.bootstrap_port, args.control_port,
                                                 [f"--tp-size={args.tp_size}"])
    try:
        _record_zmq()
        decode = DecodeSide(layout, f"127.0.0.1:{args.bootstrap_port}", args.decode_port)
        decode.connect()
        from importlib.metadata import version

        common = {"sglang_version": version("sglang"), "nixl_version": version("nixl"),
                  "layout": layout.as_dict(),
                  "captured_by": "tests/interop/sglang_prefill/capture_frames.py"}
        writer = Writer(args.out, common)
        if args.tp_size == 1:
            capture(writer, decode, args.control_port, args.bootstrap_port)
        else:
            capture_tp(writer, decode, args.control_port, args.bootstrap_port, args.tp_size)
        print("\n".join(f"wrote {args.out / n}" for n in writer.names), flush=True)
    finally:
        launch.stop(server)
        put_log.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # SGLang's decode threads are not daemon threads
