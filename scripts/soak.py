"""A bounded chaos run against real processes on loopback: what the decode worker survives.

    python scripts/soak.py --duration 60 --seed 1

Starts a prefill peer, a decode worker with tiny pools (its integrity check runs every 0.2 s: a
broken page or lock invariant stops it) and the SGLang Model Gateway (smg) when installed; runs
mixed streaming / non-streaming multi-turn traffic (P/D straight, through the router, local
prefill; `--grpc-share` of the turns, 0.25 by default, over smg's gRPC worker protocol, which
both servers then serve on `--grpc-port`) for `--duration` seconds while injecting one fault
at a time at random moments: prefill SIGKILL (then restart), prefill SIGSTOP/SIGCONT, client
disconnects mid-stream, malformed HTTP bodies, malformed protocol frames, duplicate and late
completions from a misbehaving peer, pool pressure bursts, and a SIGTERM of the decode worker
under load (then restart). Then it stops the traffic, waits for the worker to go idle and
prints, per fault kind, injected / survived and the requests sent / answered with tokens /
answered with an error / never answered (the requests started while a fault of that kind was
being injected, its own and the traffic's; the `traffic` row: while none was); the same per
door (`http`, `grpc`) and the decode worker's own count of the gRPC Generate calls it answered
OK (`decode_worker_grpc_requests_total`), which must equal the calls answered with tokens (or
may fall short after a SIGTERM: a drained worker's last counts go with it); the counters that
show the tiny pools at work (evictions, retractions, the host tier's hits, restores and skipped
writes); the page and queue gauges against their baseline; one `host tier:` line (it fails the
run when no host hit was restored: the device pool is small enough that the host tier must
carry prefixes); and last, exactly

    soak: seconds=<s> faults=<n> requests=<n> unanswered=<n> leaked_pages=<n>

It exits 1 when `unanswered` or `leaked_pages` (locked host-tier pages included) is not 0, the
gRPC counts disagree or the host tier check failed. What counts
as answered is decided in `soak_lib/traffic.py` (a refused connection only while the worker was
stopped on purpose).
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts.soak_lib import grpc_door
from scripts.soak_lib.cluster import (
    Cluster,
    Scrape,
    health_ok,
    held_pages,
    is_idle,
    value,
)
from scripts.soak_lib.faults import (
    COUNTERS,
    FAULTS,
    GRPC_OK,
    RESTART_NEEDS_S,
    RESTARTS,
    Chaos,
    deck,
)
from scripts.soak_lib.traffic import NO_FAULT, Requester, State, Tally, Traffic


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of traffic + faults")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", type=Path, help="HF model dir (default: the built-in tiny one)")
    ap.add_argument("--threads", type=int, default=4, help="concurrent conversations")
    ap.add_argument("--no-router", action="store_true", help="do not start the router (smg)")
    ap.add_argument("--grpc-share", type=float, default=0.25,
                    help="fraction of the turns sent over gRPC (0: the servers serve no gRPC)")
    ap.add_argument("--speculative-algorithm", default="NGRAM", choices=["NGRAM", "SUFFIX", "none"],
                    help="the decode worker's speculative decoding (drafts where the traffic "
                    "repeats itself: part of it)")
    ap.add_argument("--faults", default=",".join(FAULTS),
                    help="comma-separated fault kinds to inject (default: all)")
    args = ap.parse_args(argv)
    kinds = [k for k in args.faults.split(",") if k]
    if unknown := [k for k in kinds if k not in FAULTS]:
        ap.error(f"unknown fault kinds {unknown}; known: {', '.join(FAULTS)}")
    if not 0.0 <= args.grpc_share <= 1.0:
        ap.error(f"--grpc-share {args.grpc_share}: must be within [0, 1]")
    model = args.model or _tiny_model()
    cluster = Cluster(model, with_router=not args.no_router, grpc=args.grpc_share > 0,
                      spec=args.speculative_algorithm)
    try:
        cluster.start()
        return _soak(cluster, args.duration, args.seed, args.threads, kinds, args.grpc_share)
    finally:
        cluster.stop()


def _tiny_model() -> Path:
    from decode_worker.device.default_model import write_model

    return Path(write_model(Path(tempfile.mkdtemp(prefix="soak-")) / "tiny-gpt-oss", seed=0))


def _soak(cluster: Cluster, duration_s: float, seed: int, threads: int,
          kinds: list[str], grpc_share: float) -> int:
    rng = random.Random(seed)
    base = cluster.decode_metrics()
    state = State()
    tally = Tally(state)
    req = Requester(cluster, state, tally)
    chaos = Chaos(cluster, state, tally, req, random.Random(seed + 1))
    traffic = Traffic(req, seed, threads, grpc_share)
    injected: Counter[str] = Counter()
    survived: Counter[str] = Counter()
    print(f"soak: router={'yes' if cluster.router_url else 'no'} threads={threads} "
          f"grpc_share={traffic.grpc_share:g} seed={seed} duration={duration_s:g}s", flush=True)
    t0 = time.monotonic()
    traffic.start()
    _inject_until(chaos, rng, t0 + duration_s, kinds, injected, survived)
    stopped = traffic.join(90.0)
    seconds = time.monotonic() - t0
    req.close()
    end = _quiesce(cluster)
    leaked = max(0, held_pages(end) - held_pages(base))
    grpc_ok = _grpc_counts(tally, chaos, end, drained=injected["decode_sigterm"] > 0)
    _report(tally, injected, survived, chaos, base, end, stopped)
    host_ok = _check_host_tier(chaos, end)
    totals = tally.totals()
    unanswered = totals["unanswered"]
    print(f"soak: seconds={seconds:.0f} faults={sum(injected.values())} "
          f"requests={totals['sent']} unanswered={unanswered} leaked_pages={leaked}", flush=True)
    return 0 if unanswered == 0 and leaked == 0 and grpc_ok and host_ok else 1


def _check_host_tier(chaos: Chaos, end: Scrape) -> bool:
    """The host tier worked under the small device pool: prefixes were restored from it (it
    was not silently off) and every admitted host hit was restored or its restore counted as
    failed. Prints one `host tier:` line."""
    names = ("host_hit_tokens", "host_restored_tokens", "host_restore_failures",
             "host_write_failures", "host_evicted_pages")
    got = {n: int(chaos.carried.get(n, 0) + value(end, n)) for n in names}
    ok = got["host_hit_tokens"] > 0 and got["host_restored_tokens"] > 0
    ok = ok and (got["host_restore_failures"] > 0
                 or got["host_restored_tokens"] == got["host_hit_tokens"])
    print("host tier: " + " ".join(f"{k}={v}" for k, v in got.items())
          + f" pages={value(end, 'pages_capacity', pool='host'):g} "
          + ("ok" if ok else "FAILED (no host hit restored, or hits and restores disagree)"))
    return ok


def _grpc_counts(tally: Tally, chaos: Chaos, end: Scrape, drained: bool) -> bool:
    """Print the doors' rows and the worker's own count of gRPC Generate calls answered OK
    against the calls answered with tokens; whether they agree. A worker stopped by SIGTERM
    took its last counts with it (counted before the signal, calls answered while it
    drained are not): then its count may only fall short."""
    for door in ("http", "grpc"):
        row = tally.doors.get(door, Counter())
        print(f"door {door}: " + " ".join(f"{c}={row[c]}" for c in
                                          ("sent", "tokens", "error", "unanswered")))
    if not tally.doors.get("grpc"):
        return True
    worker = int(chaos.carried.get(GRPC_OK, 0) + value(end, "grpc_requests",
                                                        method=grpc_door.METHOD, code="OK"))
    client = tally.doors["grpc"]["tokens"]
    ok = worker <= client if drained else worker == client
    print(f"grpc: worker_ok={worker} client_tokens={client} "
          f"grpc_ok_checked={'no' if drained else 'yes'} {'agree' if ok else 'DISAGREE'}")
    return ok


def _inject_until(chaos: Chaos, rng: random.Random, end: float, kinds: list[str],
                  injected: Counter[str], survived: Counter[str]) -> None:
    """Faults one at a time, each after a random pause, until `end` (the last may overrun)."""
    stack: list[str] = []
    while kinds and time.monotonic() < end:
        time.sleep(min(rng.uniform(0.3, 1.5), max(0.0, end - time.monotonic())))
        if time.monotonic() >= end:
            return
        stack = stack or deck(rng, kinds)
        if stack[-1] in RESTARTS and end - time.monotonic() < RESTART_NEEDS_S:
            if all(k in RESTARTS for k in kinds):
                continue  # only restarts asked for: wait out the run
            stack = [k for k in deck(rng, kinds) if k not in RESTARTS]
        kind = stack.pop()
        chaos.state.phase = kind
        injected[kind] += 1
        t = time.monotonic()
        try:
            ok = FAULTS[kind](chaos)
        except Exception as exc:
            chaos.notes.append(f"{kind}: {exc!r}"[:300])
            ok = False
        finally:
            chaos.state.phase = NO_FAULT
        survived[kind] += int(ok)
        print(f"  {time.monotonic() - t:5.1f}s {kind}: {'survived' if ok else 'FAILED'}",
              flush=True)


def _quiesce(cluster: Cluster, timeout_s: float = 30.0) -> Scrape:
    """The decode worker's metrics once nothing is queued or running (or at the timeout)."""
    deadline = time.monotonic() + timeout_s
    while True:
        scrape = cluster.decode_metrics()
        if (is_idle(scrape) and held_pages(scrape) == 0) or time.monotonic() > deadline:
            time.sleep(0.5)  # a few more integrity checks on the idle worker
            return cluster.decode_metrics()
        time.sleep(0.2)


def _report(tally: Tally, injected: Counter[str], survived: Counter[str], chaos: Chaos,
            base: Scrape, end: Scrape, stopped: bool) -> None:
    cols = ("injected", "survived", "sent", "tokens", "error", "unanswered")
    print(f"{'fault':<22}" + "".join(f"{c:>11}" for c in cols))
    for kind in [NO_FAULT, *FAULTS]:
        row = tally.rows.get(kind, Counter())
        inj = "-" if kind == NO_FAULT else str(injected[kind])
        surv = "-" if kind == NO_FAULT else str(survived[kind])
        print(f"{kind:<22}{inj:>11}{surv:>11}" + "".join(
            f"{row[c]:>11}" for c in ("sent", "tokens", "error", "unanswered")))
    moved = {n: int(chaos.carried.get(n, 0) + value(end, n)) for n in COUNTERS}
    print("counters: " + " ".join(f"{k}={v}" for k, v in moved.items()))
    gauges = {g: (value(base, g), value(end, g)) for g in ("queue_requests", "draining")}
    print("gauges (baseline -> end): " + " ".join(
        f"{g}={a:g}->{b:g}" for g, (a, b) in gauges.items())
        + f" held_pages={held_pages(base)}->{held_pages(end)}")
    alive = health_ok(chaos.cluster.decode_url)
    print(f"integrity: {'clean' if alive else 'FAILED'} (the worker checks pages and locks "
          "every 0.2 s and stops on a broken invariant; it is "
          f"{'alive and healthy' if alive else 'not healthy'})")
    if not stopped:
        print("traffic: a conversation thread did not stop within 90 s")
    for phase, target, ans in tally.lost[:20]:
        print(f"unanswered: {phase} -> {target}: {ans.kind} {ans.status} {ans.detail[:160]}")
    for note in chaos.notes:
        print(f"note: {note}")
    print("logs: " + " ".join(chaos.cluster.logs))


if __name__ == "__main__":
    raise SystemExit(main())
