"""A stock SGLang 0.5.23 prefill node for gpt-oss-style models on the CPU (venv-only).

Run with the interpreter of scripts/setup_sglang.sh's venv; never import `decode_worker`.
README.md in this directory has the control API and what is synthetic (the forward: seeded KV,
or with `--model DIR` transformers' real prefill, forward.py).

    .venv-sglang/bin/python tests/interop/sglang_prefill/prefill_server.py \
        --bootstrap-port 18201 --control-port 18202 [--tp-size 2] [layout flags]

Prints one JSON line `{"event": "ready", ...}` on stdout once every rank has registered with
the bootstrap server; then serves the control API until killed or POST /shutdown.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import sglang_cpu
from layout import add_layout_args, layout_from_args

sglang_cpu.prepare_env()

from prefill_rank import FAIL_MODES, PrefillRank  # noqa: E402

logger = logging.getLogger("prefill_server")
_ORDER = ["failed", "error", "timeout", "accepted", "bootstrapping", "waiting_for_input",
          "transferring", "success"]


class RankProxy:
    """Rank 1..N-1 in a child process, driven over a pipe (one request/answer at a time)."""

    def __init__(self, ctx: Any, args: argparse.Namespace, rank: int) -> None:
        self.conn, child = ctx.Pipe()
        self.lock = threading.Lock()
        self.proc = ctx.Process(target=_rank_process, args=(vars(args), rank, child),
                                daemon=True, name=f"prefill-rank-{rank}")
        self.proc.start()
        child.close()

    def call(self, op: str, arg: Any = None) -> Any:
        with self.lock:
            self.conn.send((op, arg))
            return self.conn.recv()

    def ready_info(self) -> dict[str, Any]:
        _tag, info = self.conn.recv()
        return info

    def start_room(self, spec: dict[str, Any]) -> None:
        self.call("prefill", spec)

    def room_state(self, room: int) -> dict[str, Any] | None:
        return self.call("room", room)


def _rank_process(argv: dict[str, Any], rank: int, conn: Any) -> None:
    args = argparse.Namespace(**argv)
    _setup_logging(args.log_level)
    try:
        served = PrefillRank(layout_from_args(args), rank, args.bootstrap_port,
                             args.host, args.seed, args.model)
        conn.send(("ready", served.info()))
        while True:
            op, arg = conn.recv()
            if op == "prefill":
                served.start_room(arg)
                conn.send(None)
            elif op == "room":
                conn.send(served.room_state(arg))
    except (EOFError, OSError):
        pass  # the parent is gone: so is this rank
    except Exception:
        logger.exception("prefill rank %s died", rank)
    os._exit(0)  # SGLang's bootstrap thread is not a daemon thread


class PrefillNode:
    """The bootstrap server and every attention-TP rank.

    Rank 0 runs in this process; ranks 1..N-1 run in child processes (one SGLang scheduler
    process per rank, as in SGLang), or, with `--tp-in-process`, here too: each manager is
    built right after publishing its own rank, and SGLang's transfer threads read only
    rank-independent values from the process-wide context afterwards.
    """

    def __init__(self, args: argparse.Namespace) -> None:
        from sglang.srt.disaggregation.nixl.conn import NixlKVBootstrapServer

        self.args = args
        self.layout = layout_from_args(args)
        self.bootstrap = NixlKVBootstrapServer(host=args.host, port=args.bootstrap_port)
        self.ranks: list[Any] = []
        if not args.tp_in_process:
            ctx = mp.get_context("spawn")
            self.ranks = [RankProxy(ctx, args, r) for r in range(1, self.layout.tp_size)]
        local = range(self.layout.tp_size) if args.tp_in_process else range(1)
        local_ranks = [PrefillRank(self.layout, r, args.bootstrap_port, args.host, args.seed,
                                   args.model) for r in local]
        self.rank_infos = [r.info() for r in local_ranks]
        self.rank_infos += [proxy.ready_info() for proxy in self.ranks]
        self.ranks = local_ranks + self.ranks

    def prefill(self, spec: dict[str, Any]) -> None:
        for rank in self.ranks:
            rank.start_room(spec)

    def room(self, room: int) -> dict[str, Any] | None:
        ranks = [rank.room_state(room) for rank in self.ranks]
        if all(r is None for r in ranks):
            return None
        stages = [r["status"] if r else "accepted" for r in ranks]
        worst = min(stages, key=_ORDER.index)
        reasons = [r.get("reason") for r in ranks if r and r.get("reason")]
        return {"room": room, "status": worst, "reason": reasons[0] if reasons else None,
                "ranks": ranks}

    def wait_room(self, room: int, wait_s: float) -> dict[str, Any] | None:
        deadline = time.monotonic() + wait_s
        while True:
            state = self.room(room)
            done = state is not None and state["status"] in ("success", "failed", "error",
                                                             "timeout")
            if done or time.monotonic() > deadline:
                return state
            time.sleep(0.01)

    def info(self) -> dict[str, Any]:
        return {"bootstrap_port": self.args.bootstrap_port, "host": self.args.host,
                "seed": self.args.seed, "model": self.args.model,
                "layout": self.layout.as_dict(),
                "ranks": self.rank_infos}


def _validate(spec: dict[str, Any], has_model: bool) -> str | None:
    if not isinstance(spec.get("room"), int) or spec["room"] < 0:
        return "room: a non-negative int is required"
    ids = spec.get("input_ids")
    if not isinstance(ids, list) or not ids or not all(isinstance(t, int) for t in ids):
        return "input_ids: a non-empty list of ints is required"
    kind = spec.get("kv", "seeded")
    if kind not in ("seeded", "model"):
        return "kv: 'seeded' or 'model'"
    if kind == "model" and not has_model:
        return "kv 'model' needs the server started with --model DIR"
    if spec.get("fail") not in (None, *FAIL_MODES):
        return f"fail: one of {FAIL_MODES} or null"
    ranks = spec.get("fail_ranks", [])
    if not isinstance(ranks, list) or not all(isinstance(r, int) for r in ranks):
        return "fail_ranks: a list of tp ranks (default: every rank fails)"
    return None


def _handler(node: PrefillNode) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, fmt: str, *args: Any) -> None:
            logger.debug("control: " + fmt, *args)

        def _reply(self, code: int, body: Any) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path == "/health":
                return self._reply(200, {"ok": True})
            if self.path == "/info":
                return self._reply(200, node.info())
            if self.path.startswith("/rooms/"):
                state = node.room(int(self.path.rsplit("/", 1)[1]))
                return self._reply(200 if state else 404, state or {"error": "unknown room"})
            self._reply(404, {"error": f"no route {self.path}"})

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)) or 0)
            if self.path == "/shutdown":
                self._reply(200, {"ok": True})
                threading.Timer(0.1, os._exit, args=(0,)).start()
                return
            if self.path != "/prefill":
                return self._reply(404, {"error": f"no route {self.path}"})
            try:
                spec = json.loads(body or b"{}")
            except json.JSONDecodeError as exc:
                return self._reply(400, {"error": f"bad JSON: {exc}"})
            error = _validate(spec, node.args.model is not None)
            if error:
                return self._reply(400, {"error": error})
            node.prefill(spec)
            wait_s = float(spec.get("wait_s", 0.0))
            if wait_s <= 0:
                return self._reply(202, {"room": spec["room"], "status": "accepted"})
            self._reply(200, node.wait_room(spec["room"], wait_s))

    return Handler


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper()), stream=sys.stderr,
                        format="%(asctime)s %(process)d %(name)s %(levelname)s %(message)s")


def _wait_bootstrap_ready(port: int, timeout_s: float = 120.0) -> None:
    import requests

    url = (f"http://127.0.0.1:{port}/route?prefill_dp_rank=-1&prefill_cp_rank=-1"
           "&target_tp_rank=-1&target_pp_rank=-1")
    deadline = time.monotonic() + timeout_s
    while requests.get(url, timeout=5).status_code != 200:
        if time.monotonic() > deadline:
            raise SystemExit("bootstrap server never saw every rank register")
        time.sleep(0.1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--bootstrap-port", type=int, required=True)
    parser.add_argument("--control-port", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0, help="default KV seed of a room")
    parser.add_argument("--log-level", default="warning")
    parser.add_argument("--tp-in-process", action="store_true",
                        help="run every TP rank's manager in this process (default: 1 per rank)")
    add_layout_args(parser)
    args = parser.parse_args()
    _setup_logging(args.log_level)
    node = PrefillNode(args)
    _wait_bootstrap_ready(args.bootstrap_port)
    server = ThreadingHTTPServer((args.host, args.control_port), _handler(node))
    server.daemon_threads = True
    print(json.dumps({"event": "ready", "pid": os.getpid(), **node.info()}), flush=True)
    try:
        server.serve_forever()
    finally:
        os._exit(0)


if __name__ == "__main__":
    main()
