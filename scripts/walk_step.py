#!/usr/bin/env python3
"""How often following `DecodeEngine.step` through its calls comes back to a file it had left.

A reader who follows one engine step from `DecodeEngine.step` (daemon/decode/engine.py) into the
functions it calls, and theirs, moves from file to file; each time the path enters a file it had
already left, the reader is back somewhere they were. This script measures that on a real
in-process engine (the built-in tiny gpt-oss, eager, requests prefilled locally, overlap on).

The walk, as measured:
- Calls are traced with `sys.setprofile` while `DecodeEngine.step` runs; only functions defined
  in the `decode_worker` package count (a call through torch, numpy or the standard library is
  attributed to the innermost project function that made it).
- Following `now`: a call is on the walk when the callee is handed the step's time, i.e. one
  of its arguments is the very float its caller (itself on the walk) holds as its time
  (`now`, or a lambda's `t`). This gives the call graph the steps used: an edge caller ->
  callee for every distinct pair, in the order first seen.
- The walk is the depth-first traversal of that graph from `DecodeEngine.step`, each function
  expanded once, at its first call (so a loop over requests, or a helper called from five
  places, does not inflate it), callees in the order they were first called. Entering a callee
  in another file moves the walk into that file; the callee's return moves it back to the
  caller's file.
- A return to a file it had left: the walk enters file X (by a call or by a return), X is not
  the file it is in, and X was visited before. With E calls between files in the walk and F
  files, that is 2E - F + 1: each call into another file costs its return, and every entry
  after a file's first is a return.
- The traced steps are unioned (one graph): steps where requests arrive, wait for room in the
  batch, are admitted, prefilled here and start; plain decode steps; steps where requests
  finish (by length, and by a stop token) and their pages settle after the overlapped step;
  an idle step. Every path those steps take is counted once. Not in this workload: transfers
  from a prefill peer, host-tier restores, retraction, client aborts, drain.
- For scale the same count over every project call (not only those handed `now`) is printed
  too; the figure is the walk that follows `now`.

    python scripts/walk_step.py            # a few seconds
    python -m scripts.walk_step --walk     # also print the whole walk

The last line is exactly:

    walk_step: files=F returns=R

(F: the distinct project files the walk enters; R: the returns to a file it had left.)
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import decode_worker
from decode_worker.core.sampling import SamplingParams
from decode_worker.daemon.decode.bridge import AddRequest, Outbox
from decode_worker.daemon.decode.engine import DecodeEngine
from decode_worker.device.default_model import write_model
from decode_worker.io.metrics import Metrics
from decode_worker.settings import load_settings

PKG = str(Path(decode_worker.__file__).resolve().parent) + "/"
MAX_RUNNING = 3  # a batch smaller than the requests: some wait in the prealloc queue


class CallGraph:
    """Caller -> callee edges between project functions, in the order first seen. With
    `follow_now`, only functions that are handed the step's time: the callee receives, as an
    argument, the very float the caller holds in its time parameter (`now`)."""

    def __init__(self, follow_now: bool) -> None:
        self.follow_now = follow_now
        self.edges: dict[CodeType, list[CodeType]] = {}
        self._seen: set[tuple[CodeType | None, CodeType]] = set()
        self._stack: list[tuple[FrameType, str]] = []  # (frame, its time parameter)
        self.root: CodeType | None = None

    def profile(self, frame: FrameType, event: str, arg: Any) -> None:
        code = frame.f_code
        if not code.co_filename.startswith(PKG):
            return
        if event == "return":
            if self._stack and self._stack[-1][0] is frame:
                self._stack.pop()
            return
        if event != "call":
            return
        params = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
        if not self._stack:
            if self.root is None or code is self.root:
                self.root = code
                self._stack.append((frame, "now"))
            return
        parent, time_param = self._stack[-1]
        if self.follow_now:
            held, local = parent.f_locals.get(time_param), frame.f_locals
            time_param = next((p for p in params if local.get(p) is held), "")
            if not time_param or not isinstance(held, float):
                return
        if (parent.f_code, code) not in self._seen:
            self._seen.add((parent.f_code, code))
            self.edges.setdefault(parent.f_code, []).append(code)
        self._stack.append((frame, time_param))

    def reset(self) -> None:
        self._stack.clear()


class Tracer:
    """Feeds every traced call to the graphs (one profile function for all)."""

    def __init__(self, *graphs: CallGraph) -> None:
        self.graphs = graphs

    def profile(self, frame: FrameType, event: str, arg: Any) -> None:
        for graph in self.graphs:
            graph.profile(frame, event, arg)

    def trace(self, fn: Callable[[], None]) -> None:
        sys.setprofile(self.profile)
        try:
            fn()
        finally:
            sys.setprofile(None)
        for graph in self.graphs:
            graph.reset()


def short(code: CodeType) -> str:
    return code.co_filename[len(PKG):]


def name(code: CodeType) -> str:
    return getattr(code, "co_qualname", code.co_name)


def walk(graph: CallGraph) -> list[tuple[str, str, str, bool]]:
    """The depth-first walk's moves between files: (from, to, via, is_return), `via` naming
    the call that moved it (a return names the call it returns from)."""
    assert graph.root is not None
    moves: list[tuple[str, str, str, bool]] = []
    done: set[CodeType] = {graph.root}

    def visit(fn: CodeType) -> None:
        for callee in graph.edges.get(fn, []):
            if callee in done:
                continue
            done.add(callee)
            via = f"{name(fn)} -> {name(callee)}"
            if short(callee) != short(fn):
                moves.append((short(fn), short(callee), via, False))
            visit(callee)
            if short(callee) != short(fn):
                moves.append((short(callee), short(fn), via, True))

    visit(graph.root)
    return moves


def count_returns(root_file: str, moves: list[tuple[str, str, str, bool]]
                  ) -> tuple[set[str], list[tuple[str, str, str, bool]]]:
    """The files the walk visits, and the moves that come back to a file it had left."""
    visited, back = {root_file}, []
    for move in moves:
        if move[1] in visited:
            back.append(move)
        visited.add(move[1])
    return visited, back


# -- the engine and its traffic ------------------------------------------------------------------
def make_engine(model_dir: Path, loop: asyncio.AbstractEventLoop) -> DecodeEngine:
    settings = load_settings(overrides={
        "model.path": str(model_dir), "cache.page_size": 16, "cache.num_full_pages": 256,
        "cache.num_swa_pages": 64, "scheduler.cuda_graph": False,
        "scheduler.max_running_requests": MAX_RUNNING, "scheduler.overlap_schedule": True,
    }, environ={}).settings
    engine = DecodeEngine.build(settings, Metrics())
    engine.outbox = Outbox(loop, lambda events: None)
    return engine


def add(engine: DecodeEngine, rid: str, prompt_len: int, max_new: int,
        stop: tuple[int, ...] = ()) -> None:
    params = SamplingParams(max_new_tokens=max_new, temperature=0, ignore_eos=True,
                            stop_token_ids=stop)
    prompt = [3 + (i * 37 + len(rid)) % 240 for i in range(prompt_len)]
    engine.inbox.put(AddRequest(rid, prompt, params, False, None, None, None, time.monotonic()))


def run(engine: DecodeEngine, loop: asyncio.AbstractEventLoop, tracer: Tracer | None,
        until: Callable[[], bool], max_steps: int = 400) -> int:
    """Step (traced when `graph`) until `until()`; the steps taken."""
    for n in range(max_steps):
        if until():
            return n
        if tracer is None:
            engine.step(time.monotonic())
        else:
            tracer.trace(lambda: engine.step(time.monotonic()))
        loop.run_until_complete(asyncio.sleep(0))  # deliver the step's events
    raise RuntimeError(f"the engine did not get there in {max_steps} steps")


def measure(model_dir: Path, tracer: Tracer) -> None:
    """Trace the steps of a small workload: two requests decoding, then more arrive (one
    waits for room), one ends by a stop token, the rest by length, and the engine idles."""
    loop = asyncio.new_event_loop()
    engine = make_engine(model_dir, loop)
    table = engine.table
    add(engine, "warm0", 40, 40)
    add(engine, "warm1", 24, 12)
    run(engine, loop, None, lambda: len(table.running.order().lives) == 2)
    run(engine, loop, None, lambda: len(table.lives["warm0"].req.output_ids) >= 4)
    add(engine, "late0", 30, 20)  # arrive, admit, start: the batch fills up
    add(engine, "late1", 50, 16)  # waits in the prealloc queue for a place in the batch
    stop_id = table.lives["warm0"].req.output_ids[-1]  # greedy: warm0 repeats itself
    add(engine, "stop0", 20, 30, stop=(stop_id,))
    run(engine, loop, tracer, lambda: not table.lives and not engine.stepper.busy)
    run(engine, loop, tracer, lambda: not table.parked, max_steps=4)
    tracer.trace(lambda: engine.step(time.monotonic()))  # idle: the inbox wait, nothing else
    engine.books.check_integrity()
    engine.receiver.close()
    loop.close()


def report(graph: CallGraph, show_walk: bool, quiet: bool = False) -> tuple[int, int]:
    moves = walk(graph)
    assert graph.root is not None
    root_file = short(graph.root)
    visited, back = count_returns(root_file, moves)
    if quiet:
        return len(visited), len(back)
    if show_walk:
        print("the walk (<- a return edge, * back in a file it had left):")
        seen = {root_file}
        for _src, dst, via, is_ret in moves:
            mark = "*" if dst in seen else " "
            seen.add(dst)
            print(f"  {mark} {'<-' if is_ret else '->'} {dst:38s} {via}")
        print()
    by_pair = Counter((src, dst) for src, dst, _, _ in back)
    print(f"{'returns':>7}  {'from':38s} {'to':38s} first via")
    for (src, dst), n in by_pair.most_common():
        via = next(v for s, d, v, _ in back if (s, d) == (src, dst))
        print(f"{n:>7}  {src:38s} {dst:38s} {via}")
    print(f"\nfiles visited ({len(visited)}): {', '.join(sorted(visited))}")
    return len(visited), len(back)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--walk", action="store_true", help="print every move of the walk")
    args = ap.parse_args(argv)
    now_walk, every_call = CallGraph(follow_now=True), CallGraph(follow_now=False)
    with tempfile.TemporaryDirectory(prefix="walk-step-") as tmp:
        measure(write_model(Path(tmp) / "tiny", seed=0), Tracer(now_walk, every_call))
    all_files, all_returns = report(every_call, False, quiet=True)
    print(f"every project call (for scale): files={all_files} returns={all_returns}\n")
    files, returns = report(now_walk, args.walk)
    print(f"walk_step: files={files} returns={returns}")


if __name__ == "__main__":
    main()
