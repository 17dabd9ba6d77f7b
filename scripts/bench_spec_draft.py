"""Drafting cost per decode step: the drafters (core/spec) at batch B (64) and K (8).

B requests run at once, as in the decode batch: each step proposes drafts for all of them in
one `propose` call, checks every draft against the request's known response (greedy: the
longest matching prefix is accepted, plus one bonus token), and `accept`s what was kept; a
request whose response is done is `finish`ed (into the shared memory) and the next one starts
in its slot. Reported per algorithm: CPU time per step for propose + accept over the whole
batch (the part on the decode step's critical path, to set against its host budget), for
`flush` (the indexing that waits for the verify forward to run), start and finish per request
(with their flush: per 1k prompt tokens, indexing), and the tokens earned per verify.

Workloads (`--workload`): `edit` (default: each response rewrites its prompt's "file" with
small edits, as an agent editing code; a few files recur, so later requests find earlier
answers), `novel` (responses of fresh random tokens: drafts fail, every step searches: the
worst case for cost), or `--trace FILE` (a spec-sim trace: text needs quicktok-v1). With
arctic-inference importable, its SuffixDecodingCache runs the same loop beside SUFFIX.

    python scripts/bench_spec_draft.py [--batch 64] [--k 8] [--steps 400] [--workload edit]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from decode_worker.core.spec import SpecParams, make_drafter
from decode_worker.core.spec.replay import common_prefix

Request = tuple[list[int], list[int]]  # prompt, response


def edit_requests(rng: random.Random, file_len: int = 1500, files: int = 40) -> Iterator[Request]:
    """Endless requests: rewrite one of `files` token 'files' with a few small edits."""
    vocab = [int(rng.paretovariate(1.1)) % 50_000 + 300 for _ in range(20_000)]
    bodies = [[rng.choice(vocab) for _ in range(file_len)] for _ in range(files)]
    while True:
        i = rng.randrange(files)
        before = bodies[i]
        after = list(before)
        for _ in range(rng.randint(1, 6)):
            at, cut = rng.randrange(len(after)), rng.randint(0, 20)
            after[at:at + cut] = [rng.choice(vocab) for _ in range(rng.randint(0, 20))]
        bodies[i] = after
        yield [1, 2, 3, *before], after


def novel_requests(rng: random.Random, prompt_len: int = 1500,
                   response_len: int = 400) -> Iterator[Request]:
    while True:
        yield ([rng.randrange(200_000) for _ in range(prompt_len)],
               [rng.randrange(200_000) for _ in range(response_len)])


def trace_requests(path: Path) -> Iterator[Request]:
    from decode_worker.daemon.spec_sim import _encoder, load_trace

    records = load_trace(path, _encoder(None))
    while True:
        yield from ((r.prompt, r.response) for r in records)


@dataclass
class Slot:
    rid: str
    prompt: list[int]
    response: list[int]
    at: int = 0
    tokens: list[int] = field(default_factory=list)  # prompt + accepted (arctic's context)


@dataclass
class Totals:
    steps: int = 0
    step_s: float = 0.0  # propose + accept: the decode step's critical path
    flush_s: float = 0.0  # flush: while the verify forward runs
    started: int = 0
    prompt_tokens: int = 0
    start_finish_s: float = 0.0
    output: int = 0
    proposed: int = 0
    accepted: int = 0


class ArcticDrafter:
    """arctic-inference's SuffixDecodingCache behind the `Drafter` calls the bench makes."""

    def __init__(self, params: SpecParams) -> None:
        from arctic_inference.suffix_decoding import SuffixDecodingCache

        self.p = params
        self.cache = SuffixDecodingCache(params.suffix_max_tree_depth,
                                         params.suffix_max_cached_requests)
        self.ctx: dict[str, list[int]] = {}

    def start(self, rid: str, prompt_ids: list[int]) -> None:
        self.cache.start_request(rid, prompt_ids)
        self.ctx[rid] = list(prompt_ids)

    def propose(self, rids: list[str], max_tokens: list[int]) -> list[list[int]]:
        depth = self.p.suffix_max_tree_depth
        return [list(self.cache.speculate(
            rid, self.ctx[rid][-depth:], max_spec_tokens=k,
            max_spec_factor=self.p.suffix_max_spec_factor,
            min_token_prob=self.p.suffix_min_token_prob).token_ids)
            for rid, k in zip(rids, max_tokens, strict=True)]

    def accept(self, rid: str, token_ids: list[int]) -> None:
        self.cache.add_active_response(rid, token_ids)
        self.ctx[rid] += token_ids

    def finish(self, rid: str) -> None:
        self.cache.stop_request(rid)
        del self.ctx[rid]

    def flush(self) -> None:
        """arctic indexes as it goes: nothing waits."""


def run(make: Callable[[], object], source: Iterator[Request], batch: int, k: int,
        steps: int) -> Totals:
    drafter = make()
    totals, clock, n = Totals(), time.process_time, 0
    slots: list[Slot] = []

    def start() -> Slot:
        nonlocal n
        prompt, response = next(source)
        n += 1
        slot = Slot(f"r{n}", prompt, response)
        t0 = clock()
        drafter.start(slot.rid, prompt)  # type: ignore[attr-defined]
        drafter.flush()  # type: ignore[attr-defined]
        totals.start_finish_s += clock() - t0
        totals.started += 1
        totals.prompt_tokens += len(prompt)
        return slot

    slots = [start() for _ in range(batch)]
    for _ in range(steps):
        t0 = clock()
        drafts = drafter.propose([s.rid for s in slots], [k] * batch)  # type: ignore[attr-defined]
        t1 = clock()
        drafter.flush()  # type: ignore[attr-defined]
        totals.flush_s += clock() - t1
        runs = []
        for s, draft in zip(slots, drafts, strict=True):
            accepted = common_prefix(draft, s.response, s.at)
            runs.append(s.response[s.at:s.at + accepted + 1])
            totals.proposed += len(draft)
            totals.accepted += accepted
            s.at += accepted + 1
            totals.output += len(runs[-1])
        t2 = clock()
        for s, kept in zip(slots, runs, strict=True):
            drafter.accept(s.rid, kept)  # type: ignore[attr-defined]
        totals.step_s += (t1 - t0) + (clock() - t2)
        totals.steps += 1
        for i, s in enumerate(slots):
            if s.at >= len(s.response):
                t0 = clock()
                drafter.finish(s.rid)  # type: ignore[attr-defined]
                drafter.flush()  # type: ignore[attr-defined]
                totals.start_finish_s += clock() - t0
                slots[i] = start()
    return totals


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--workload", choices=("edit", "novel"), default="edit")
    parser.add_argument("--trace", type=Path, help="a spec-sim trace instead of --workload")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeat", type=int, default=3,
                        help="runs per algorithm; the fastest is reported (least disturbed)")
    args = parser.parse_args(argv)
    makers: dict[str, Callable[[], object]] = {}
    for name in ("NGRAM", "SUFFIX"):
        params = SpecParams(algorithm=name, num_draft_tokens=args.k)  # type: ignore[arg-type]
        makers[name] = lambda p=params: make_drafter(p)
    try:
        import arctic_inference.suffix_decoding  # noqa: F401

        params = SpecParams(algorithm="SUFFIX", num_draft_tokens=args.k)
        makers["arctic SUFFIX"] = lambda p=params: ArcticDrafter(p)
    except ImportError:
        print("(arctic-inference not installed: no arctic column)")
    workload = str(args.trace) if args.trace else args.workload
    print(f"bench_spec_draft: batch={args.batch} K={args.k} steps={args.steps} "
          f"workload={workload} (CPU time)")
    for name, make in makers.items():
        def source_of() -> Iterator[Request]:
            if args.trace:
                return trace_requests(args.trace)
            make_source = edit_requests if args.workload == "edit" else novel_requests
            return make_source(random.Random(args.seed))

        t = min((run(make, source_of(), args.batch, args.k, args.steps)
                 for _ in range(args.repeat)), key=lambda t: t.step_s)
        per_req = t.start_finish_s / max(t.started, 1) * 1e3
        per_1k = t.start_finish_s / max(t.prompt_tokens, 1) * 1e6
        verifies = t.steps * args.batch
        print(f"{name}: us_per_step={t.step_s / t.steps * 1e6:.0f} "
              f"(per request {t.step_s / verifies * 1e6:.2f}) "
              f"flush_us_per_step={t.flush_s / t.steps * 1e6:.0f} start+finish_ms_per_request="
              f"{per_req:.2f} (per 1k prompt tokens {per_1k:.2f}) "
              f"accept_length={t.output / verifies:.2f} proposed={t.proposed} "
              f"efficiency={t.accepted / max(t.proposed, 1):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
