"""A decode stepper over a runner with requests added straight into the batch, with or without
speculative decoding, and drafters that propose what a test wants (right, wrong, stop ids,
too long): for comparing speculation on against off token by token."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from decode_worker.core.admission import Admit, PreallocQueue, QueueLimits
from decode_worker.core.decode_alloc import DecodeAllocator
from decode_worker.core.kv_context import KVContext
from decode_worker.core.pages import PageAllocator
from decode_worker.core.radix_tree import UnifiedRadixTree
from decode_worker.core.req_kv import ReqKV
from decode_worker.core.request import RequestState
from decode_worker.core.sampling import SamplingParams
from decode_worker.core.spec.drafter import DrafterStats
from decode_worker.daemon.decode.batch import RunningBatch
from decode_worker.daemon.decode.bridge import AddRequest, Tokens, per_request
from decode_worker.daemon.decode.fetcher import AuxBuffers, KVFetcher
from decode_worker.daemon.decode.live import LiveRequest
from decode_worker.daemon.decode.requests import RequestTable
from decode_worker.daemon.decode.speculate import Speculator
from decode_worker.daemon.decode.stepper import DecodeStepper, sample_kind
from decode_worker.device.aux_buffer import AuxBuffer
from decode_worker.device.sampler import Sampler
from decode_worker.device.sglang_aux import SglangAuxBuffers
from decode_worker.utils.mathx import cdiv
from tests.fakes.fake_device import FakeIdleReceiver, SinkOutbox, _NoTransfers

DraftFn = Callable[[str, list[int], int], list[int]]


class ScriptedDrafter:
    """A `Drafter` whose proposals come from `fn(rid, tokens so far, k)` (it may return more
    than k: the policy cuts them)."""

    def __init__(self, fn: DraftFn) -> None:
        self.fn = fn
        self.tokens: dict[str, list[int]] = {}
        self.finished: list[str] = []

    def start(self, rid: str, prompt_ids: Sequence[int], output_ids: Sequence[int] = ()) -> None:
        self.tokens[rid] = [*prompt_ids, *output_ids]

    def propose(self, rids: Sequence[str], max_tokens: Sequence[int]) -> list[list[int]]:
        return [self.fn(rid, self.tokens[rid], k) for rid, k in zip(rids, max_tokens,
                                                                     strict=True)]

    def accept(self, rid: str, token_ids: Sequence[int]) -> None:
        self.tokens[rid] += token_ids

    def finish(self, rid: str, keep: bool = True) -> None:
        self.tokens.pop(rid, None)
        self.finished.append(rid)

    def flush(self) -> None:
        pass

    def stats(self) -> DrafterStats:
        return DrafterStats(len(self.tokens), 0, 0)

    def check_integrity(self) -> None:
        pass


class Rig:
    """A stepper with `num_rows` rows over pools of `full_pages` / `swa_pages` (a radix tree
    when `radix`); `spec` on or off."""

    def __init__(self, runner: Any, *, spec: Speculator | None, overlap: bool = True,
                 page_size: int = 16, window: int = 127, num_rows: int = 16,
                 full_pages: int = 512, swa_pages: int = 256, radix: bool = False,
                 seed: int = 0) -> None:
        self.full, self.swa = PageAllocator(full_pages, "full"), PageAllocator(swa_pages, "swa")
        tree = UnifiedRadixTree(page_size, window, self.full, self.swa) if radix else None
        self.ctx = KVContext(tree, self.full, self.swa, page_size=page_size, window=window,
                             radix_cache=radix)
        queue = PreallocQueue(self.ctx, QueueLimits(max_queued=num_rows, max_active=num_rows,
                                                    decode_reserve_tokens=0))
        self.alloc = DecodeAllocator(self.ctx)
        batch = RunningBatch(runner.new_inputs(num_rows), self.alloc, sample_kind)
        sampler = Sampler("cpu", seed=seed)
        fetcher = KVFetcher(FakeIdleReceiver(), AuxBuffers(AuxBuffer(1), SglangAuxBuffers(1)),  # type: ignore[arg-type]
                            self.ctx, runner, sampler)
        self.outbox = SinkOutbox(keep=True)
        self.table = RequestTable(self.ctx, queue, self.alloc, _NoTransfers(), fetcher,
                                  self.outbox, batch, spec.ended if spec is not None else None,
                                  eos_ids=frozenset({0}))
        self.stepper = DecodeStepper(self.table, queue, self.alloc, runner, sampler,
                                     overlap=overlap, spec=spec)
        self.lives: dict[str, LiveRequest] = {}
        self.runner = runner

    def add(self, rid: str, prompt: list[int], first: int | None, params: SamplingParams,
            *, return_logprob: bool = False, top_logprobs: int = 0) -> LiveRequest:
        """A request straight into the batch with its prompt's KV in its pages: computed by the
        runner's prefill when `first` is None (its first token the argmax), else left as the
        pages hold it (a stand-in runner that reads no KV) with first token `first`."""
        ps, ctx = self.ctx.page_size, self.ctx
        live = self.table.register(AddRequest(rid, prompt, params, return_logprob, None, None,
                                              None, 0.0, top_logprobs=top_logprobs))
        swa_start, n = ctx.swa_start(len(prompt)), cdiv(len(prompt), ps)
        swa_ids = [0] * (swa_start // ps) + self.swa.alloc(n - swa_start // ps)
        kv = ReqKV(list(prompt), self.full.alloc(n), swa_ids, swa_start=swa_start)
        live.req.transition(RequestState.RESERVED, 0.0, kv=kv)
        if first is None:
            first = int(self.runner.prefill(prompt, kv.full_page_ids, swa_ids).argmax())
        live.req.transition(RequestState.READY, 0.0, first_token=first)
        if return_logprob or top_logprobs:
            live.record_logprobs(-1.0, [(first, -1.0)] * top_logprobs)
        self.stepper.start(live, 0.0)
        self.lives[rid] = live
        return live

    def readmit(self) -> int:
        """Admit what the prealloc queue holds (requests the stepper retracted, whose KV the tree
        keeps) and put them back into the batch with their own last token, as the engine does
        for a resumed request (this runner reads no KV: nothing is prefilled). How many."""
        admitted = 0
        for d in self.table.queue.pop_admitted(0.0):
            assert isinstance(d, Admit), d
            live = self.lives[d.req.rid]
            live.req.transition(RequestState.READY, 0.0, first_token=live.req.output_ids[-1])
            self.stepper.start(live, 0.0)
            admitted += 1
        return admitted

    def run(self, max_steps: int = 10_000) -> dict[str, list[int]]:
        """Step until every request ended; each request's output tokens. Checks that the
        tokens sent are exactly the tokens committed, in order."""
        for _ in range(max_steps):
            if not self.table.lives and not self.stepper.busy:
                break
            self.stepper.step(0.0)
            self.table.poll(0.0)
            self.readmit()
        else:
            raise AssertionError("requests did not end")
        self.table.poll(0.0)
        sent: dict[str, list[int]] = {rid: [] for rid in self.lives}
        for ev in per_request(self.outbox.events):
            if isinstance(ev, Tokens):
                sent[ev.rid] += ev.chunk.token_ids
        out = {rid: lv.req.output_ids for rid, lv in self.lives.items()}
        assert sent == out, "the tokens sent are not the tokens committed"
        return out

    def check_pages(self) -> None:
        """Every request ended and nothing of theirs is held: pages free or in the tree."""
        assert not self.table.parked and not self.table.lives
        if self.ctx.tree is not None:
            self.ctx.tree.check_integrity([], [])
        else:
            assert self.full.num_free == self.full.num_total
            assert self.swa.num_free == self.swa.num_total
