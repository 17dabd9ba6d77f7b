"""One decode worker's KV side, driven as the engine drives it, for the host-tier bench.

The real pure core decides everything: `PreallocQueue` admits (TRANSFER match, host hits
advertised only when locked, the restore's device pages counted in the full budget),
`DecodeAllocator` grows, slides and retracts, the `UnifiedRadixTree` caches, evicts, demotes and
writes to the host tier. The real `HostKVPool` makes every copy on the real KV pool layout: a
write (device -> host) the moment the tree decides it (the tree's `write_sink`, as
`daemon/decode/host_tier.py` wires it) and a restore (host -> device) for every admission with
host hits, timed, beside a plain `torch` copy of the same number of bytes.

What the bench fakes is only what a transfer and a model step would put in the pages: every
token's KV slots hold a signature of (token id, position), stamped when the "transfer" lands and
when a "step" writes a position, so that each restore is checked bit-exact.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import torch

from decode_worker.core.admission import Admit, PreallocQueue, QueueLimits
from decode_worker.core.decode_alloc import DecodeAllocator
from decode_worker.core.host_tier import HostRestore, HostWrite, WritePolicy
from decode_worker.core.kv_context import KVContext
from decode_worker.core.pages import PageAllocator
from decode_worker.core.radix_tree import UnifiedRadixTree
from decode_worker.core.request import DecodeRequest, RequestState, StepCommit, held_page_ids
from decode_worker.device.host_pool import HostKVPool
from decode_worker.device.kv_pool import KVPools, KVSpec
from scripts.host_tier_lib.workload import Chat

S = RequestState


@dataclass(frozen=True, slots=True)
class Setup:
    """One run: pool sizes in pages (`host_pages` 0: no host tier) and the write policy."""

    label: str
    device_pages: int
    host_pages: int = 0
    policy: WritePolicy = WritePolicy.WRITE_THROUGH


@dataclass(slots=True)
class Result:
    """What one run measured (tokens, bytes, seconds)."""

    setup: Setup
    later_prompt_tokens: int = 0
    later_reused_tokens: int = 0  # device + host hits advertised at first admission
    later_host_tokens: int = 0
    sent_bytes: int = 0  # KV bytes the prefill sends, every admission (retractions too)
    retractions: int = 0
    evicted_pages: int = 0
    written_bytes: int = 0
    evict_written_bytes: int = 0  # of it, copies made by device eviction (write-back)
    write_s: float = 0.0
    restores: int = 0
    restore_bytes: int = 0
    restore_s: float = 0.0
    copy_s: float = 0.0  # the plain copies of the same bytes
    steps: int = 0
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def hit(self) -> float:
        return self.later_reused_tokens / max(1, self.later_prompt_tokens)


def _signature(tokens: list[int], start: int) -> torch.Tensor:
    """The value every KV slot of position `start + i` holds: an integer below 251 (exact in
    float32 and bfloat16), mixing the token id and the position."""
    pos = torch.arange(start, start + len(tokens), dtype=torch.int64)
    return ((torch.tensor(tokens, dtype=torch.int64) * 7919 + pos * 31) % 251).float()


class Worker:
    """The pools, tree, admission and decode allocator of one decode worker (see module)."""

    def __init__(self, setup: Setup, spec: KVSpec, page_size: int, window: int,
                 concurrency: int, dtype: torch.dtype, check_every: int = 0) -> None:
        """`check_every`: check the tree's integrity every that many steps (0: at the end)."""
        self.setup, self.ps, self.check_every = setup, page_size, check_every
        full = PageAllocator(setup.device_pages, "full")
        swa = PageAllocator(concurrency * (2 * window // page_size + 8) + 64, "swa")
        host = PageAllocator(setup.host_pages, "host") if setup.host_pages else None
        self.tree = UnifiedRadixTree(page_size, window, full, swa, host=host,
                                     write_policy=setup.policy)
        self.ctx = KVContext(self.tree, full, swa, page_size=page_size, window=window,
                             radix_cache=True)
        self.queue = PreallocQueue(self.ctx, QueueLimits(max_active=concurrency))
        self.dec = DecodeAllocator(self.ctx)
        self.pools: KVPools | None = None
        self.host: HostKVPool | None = None
        if host is not None:
            self.pools = KVPools(spec, setup.device_pages, 0, page_size, "cpu", dtype)
            self.host = HostKVPool(self.pools, setup.host_pages)
            self.tree.write_sink = self._timed_write
            self._evicting = False
            evict = self.tree.evict_full

            def evict_full(num_pages: int, *, write_back: bool = True) -> list[int]:
                self._evicting = True  # a copy made now delays the reuse of freed pages
                try:
                    return evict(num_pages, write_back=write_back)
                finally:
                    self._evicting = False

            self.tree.evict_full = evict_full  # type: ignore[method-assign]
            nbytes = min(self.host.total_bytes(), 1 << 28)
            # plain-copy source and destination, touched (as the pools are) so that no page
            # fault is timed; used round-robin so that they are as cold as the pools' pages
            self._src = torch.ones(nbytes, dtype=torch.uint8)
            self._dst = torch.ones(nbytes, dtype=torch.uint8)
            self._at = 0
        swa_layers = spec.num_swa_layers
        self.full_token_bytes = spec.page_bytes(1, dtype) * spec.num_full_layers
        self.swa_token_bytes = spec.page_bytes(1, dtype) * swa_layers
        self.res = Result(setup)

    # -- copies ------------------------------------------------------------------------------
    def _timed_write(self, job: HostWrite) -> None:
        assert self.host is not None
        t0 = time.process_time()
        self.host.write(job)
        self.res.write_s += time.process_time() - t0
        if self._evicting:
            self.res.evict_written_bytes += len(job.host_page_ids) * self.host.page_bytes

    def _restore(self, req: DecodeRequest, job: HostRestore, device_prefix: int) -> None:
        """The real restore, timed, then a plain copy of the same bytes, timed; then the
        restored pages are checked against the tokens they must hold."""
        assert self.host is not None and self.pools is not None
        t0 = time.process_time()
        handle = self.host.restore(job)
        t1 = time.process_time()
        n = handle.num_bytes
        if self._at + n > self._src.numel():
            self._at = 0
        src, dst = self._src[self._at:self._at + n], self._dst[self._at:self._at + n]
        self._at += n
        t2 = time.process_time()
        dst.copy_(src)
        t3 = time.process_time()
        r = self.res
        r.restores += 1
        r.restore_bytes += n
        r.restore_s += t1 - t0
        r.copy_s += t3 - t2
        lo = device_prefix
        want = _signature(req.fill_ids[lo:lo + job.num_pages * self.ps], lo)
        got = self.pools.full[:, job.device_page_ids]  # [L, n, 2, ps, H, D]
        want = want.view(1, job.num_pages, 1, self.ps, 1, 1).to(got.dtype).expand_as(got)
        if not torch.equal(got, want):
            raise AssertionError(f"req={req.rid}: restored KV differs from what was written")

    def _stamp(self, req: DecodeRequest, lo: int, hi: int) -> None:
        """Write the KV signature of positions [lo, hi) into the request's pages."""
        if self.pools is None or hi <= lo:
            return
        kv = req.kv
        assert kv is not None
        ps, tokens = self.ps, kv.token_ids if hi <= kv.seq_len else req.fill_ids
        pages = torch.tensor([kv.full_page_ids[p // ps] for p in range(lo, hi)])
        offs = torch.tensor([p % ps for p in range(lo, hi)])
        # full[:, pages, :, offs]: [hi - lo, L, 2, H, D]
        self.pools.full[:, pages, :, offs] = _signature(tokens[lo:hi], lo).view(
            -1, 1, 1, 1, 1).to(self.pools.full.dtype)

    # -- the loop ----------------------------------------------------------------------------
    def run(self, chats: list[Chat]) -> Result:
        """Every chat's turns, one after the other per chat, all chats at once (interleaved by
        admission order); returns the counts. Raises on any broken invariant."""
        pending = deque(DecodeRequest(f"c{c}t0", c, chats[c].prompt(0),
                                      len(chats[c].turns[0][1])) for c in range(len(chats)))
        running: list[DecodeRequest] = []
        turn_of: dict[str, tuple[int, int]] = {r.rid: (i, 0) for i, r in enumerate(pending)}
        seen: set[str] = set()
        step = 0
        while pending or running or self.queue.num_queued:
            now = step * 1e-3
            while pending:
                assert self.queue.enqueue(pending.popleft(), now) is None
            for d in self.queue.pop_admitted(now):
                if not isinstance(d, Admit):
                    raise AssertionError(f"{d.req.rid} aborted: {d.message}")
                c, t = turn_of[d.req.rid]
                self._admitted(d, chats[c].turns[t][1], t, first=d.req.rid not in seen)
                seen.add(d.req.rid)
                running.append(d.req)
            if not running:
                raise AssertionError("nothing runs and nothing is admitted")
            self._step(running, now, chats, turn_of, pending)
            step += 1
            if self.check_every and step % self.check_every == 0:
                self.tree.check_integrity(*held_page_ids(running, self.ps))
        self.res.steps = step
        self.res.evicted_pages = self.ctx.stats.evicted_full_pages_total
        self.res.retractions = self.ctx.stats.retractions_total
        if self.host is not None:
            self.res.written_bytes = self.host.written_bytes_total
        self.tree.check_integrity()
        return self.res

    def _admitted(self, d: Admit, answer: list[int], turn: int, *, first: bool) -> None:
        """Restore, the transfer landing with the first token, then the request runs."""
        req, r = d.req, self.res
        fill = req.fill_len
        r.sent_bytes += ((fill - d.prefix_len) * self.full_token_bytes
                         + (fill - d.swa_start) * self.swa_token_bytes)
        host_len = d.restore.num_pages * self.ps if d.restore is not None else 0
        if first and turn > 0:
            r.later_prompt_tokens += len(req.prompt_ids)
            r.later_reused_tokens += d.prefix_len
            r.later_host_tokens += host_len
        if d.restore is not None:
            self._restore(req, d.restore, d.prefix_len - host_len)
        self._stamp(req, d.prefix_len, fill)  # the transfer lands
        req.transition(RequestState.READY, 0.0, first_token=answer[0])
        req.transition(RequestState.RUNNING, 0.0, keeper=self.dec.ctx)

    def _step(self, running: list[DecodeRequest], now: float, chats: list[Chat],
              turn_of: dict[str, tuple[int, int]], pending: deque[DecodeRequest]) -> None:
        """One decode step over the batch; finished turns queue the chat's next turn."""
        plan = self.dec.prepare_step(running, now)
        if plan.retracted:
            self.queue.requeue(plan.retracted, now)
            for req in plan.retracted:
                running.remove(req)
        for req in plan.runnable:
            c, t = turn_of[req.rid]
            answer = chats[c].turns[t][1]
            pos = req.kv.seq_len  # type: ignore[union-attr]  # RUNNING
            StepCommit([req]).commit([answer[len(req.output_ids)]])
            self._stamp(req, pos, pos + 1)
            if len(req.output_ids) == len(answer):
                req.transition(RequestState.FINISHED, now, keeper=self.dec.ctx)
                running.remove(req)
                if t + 1 < len(chats[c].turns):
                    nxt = DecodeRequest(f"c{c}t{t + 1}", c, chats[c].prompt(t + 1),
                                        len(chats[c].turns[t + 1][1]))
                    turn_of[nxt.rid] = (c, t + 1)
                    pending.append(nxt)
