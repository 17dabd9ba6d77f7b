"""Serving benchmark: a real `decode-worker serve`, concurrent streaming clients, and how fast
`/health` answers while the compute thread decodes.

    python scripts/bench_serve.py [--clients 16] [--requests 64] [--max-new 64]

Requests carry no bootstrap fields, so the decode worker prefills them itself (one process, no
prefill peer); the point is the event loop's responsiveness and the decode loop's throughput
behind the real HTTP stack. Prints tokens/s, request latency and /health latency percentiles
(idle and under load).
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from decode_worker.daemon.shared.procs import ServerProcess
from decode_worker.device.default_model import write_model


def stream_one(port: int, prompt: list[int], max_new: int) -> tuple[float, int]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    body = json.dumps({"input_ids": prompt, "stream": True, "sampling_params": {
        "max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}})
    t0 = time.monotonic()
    conn.request("POST", "/generate", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    tokens = 0
    for line in resp:
        if line.startswith(b"data: {"):
            tokens = len(json.loads(line[6:]).get("output_ids", [])) or tokens + 1
    conn.close()
    return time.monotonic() - t0, tokens


def health_probe(port: int, stop: threading.Event, out: list[float]) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    while not stop.is_set():
        t0 = time.monotonic()
        conn.request("GET", "/health")
        conn.getresponse().read()
        out.append((time.monotonic() - t0) * 1e3)
        time.sleep(0.01)
    conn.close()


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--prompt-len", type=int, default=200)
    ap.add_argument("--max-new", type=int, default=64)
    args = ap.parse_args()
    model = write_model(Path(tempfile.mkdtemp()) / "tiny", seed=0)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 250) for _ in range(args.prompt_len)]
               for _ in range(args.requests)]
    with ServerProcess("decode", ["serve", "--model", str(model), "--port", "0",
                                  "--set", "cache.num_full_pages=4096",
                                  "--set", "cache.num_swa_pages=1024",
                                  "--set", "scheduler.max_running_requests=64"]) as srv:
        srv.wait_ready(120)
        port = srv.port
        idle: list[float] = []
        stop = threading.Event()
        t = threading.Thread(target=health_probe, args=(port, stop, idle))
        t.start()
        time.sleep(1.0)
        stop.set()
        t.join()
        loaded: list[float] = []
        stop = threading.Event()
        t = threading.Thread(target=health_probe, args=(port, stop, loaded))
        t.start()
        t0 = time.monotonic()
        with ThreadPoolExecutor(args.clients) as pool:
            results = list(pool.map(lambda p: stream_one(port, p, args.max_new), prompts))
        wall = time.monotonic() - t0
        stop.set()
        t.join()
    lat = [r[0] for r in results]
    toks = sum(r[1] for r in results)
    print(f"clients={args.clients} requests={args.requests} prompt={args.prompt_len} "
          f"max_new={args.max_new}")
    print(f"throughput: {toks / wall:.1f} tok/s ({toks} tokens in {wall:.1f}s)")
    print(f"request latency: p50 {statistics.median(lat):.2f}s p99 {pct(lat, 0.99):.2f}s")
    print(f"/health idle:  p50 {pct(idle, 0.5):.2f} ms p99 {pct(idle, 0.99):.2f} ms "
          f"(n={len(idle)})")
    print(f"/health load:  p50 {pct(loaded, 0.5):.2f} ms p99 {pct(loaded, 0.99):.2f} ms "
          f"max {max(loaded):.2f} ms (n={len(loaded)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
