"""The compute thread: owns torch, the pools, the tree, the prealloc queue and NIXL.

The engine is a composition of parts, each built here with what it needs:
- `RequestTable` (`requests.py`): the requests, their commands, admission, and the one exit
  every request leaves by (the engine enters it once a step: `RequestTable.step`);
- `KVFetcher` (`fetcher.py`): transfers (or local prefill) for admitted requests;
- `DecodeStepper` (`stepper.py`): the decode batch, one token per request per step;
- `Books` (`books.py`): metrics, gauges, load, cache flush and the integrity check.

Any exception in a step is a broken invariant or a device failure: the engine posts
`EngineDead` and stops, so the daemon exits and its supervisor restarts it. Per-request problems
never raise out of a step.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from decode_worker.core.admission import PreallocQueue, QueueLimits
from decode_worker.core.decode_alloc import DecodeAllocator
from decode_worker.core.host_tier import WritePolicy
from decode_worker.core.kv_context import KVContext
from decode_worker.core.pages import PageAllocator
from decode_worker.core.radix_tree import UnifiedRadixTree
from decode_worker.core.spec.drafter import make_drafter
from decode_worker.daemon.decode.batch import RunningBatch
from decode_worker.daemon.decode.books import Books
from decode_worker.daemon.decode.bridge import (
    BackendInfo,
    CacheFlushed,
    EngineDead,
    FlushCache,
    Inbox,
    Outbox,
    Shutdown,
)
from decode_worker.daemon.decode.fetcher import AuxBuffers, KVFetcher
from decode_worker.daemon.decode.host_tier import HostTier
from decode_worker.daemon.decode.landing import LandingDock
from decode_worker.daemon.decode.requests import RequestTable
from decode_worker.daemon.decode.speculate import Speculator, StepCost
from decode_worker.daemon.decode.stepper import DecodeStepper, sample_kind
from decode_worker.daemon.shared.compat import landing_region, model_compat, region_layouts
from decode_worker.daemon.shared.host_plan import HostPlan, host_tier_enabled, plan_host_tier
from decode_worker.daemon.shared.runtime import Runtime, build_runtime
from decode_worker.device.aux_buffer import AuxBuffer
from decode_worker.device.sampler import Sampler
from decode_worker.device.sglang_aux import SglangAuxBuffers
from decode_worker.device.tokenizer import Tokenizer
from decode_worker.io.kv.router import ProtocolRouter
from decode_worker.io.kv_events.hub import KvEventHub
from decode_worker.io.metrics import Metrics
from decode_worker.settings import Settings

log = logging.getLogger(__name__)
_IDLE_WAIT_S = 0.02  # how long an idle engine blocks on its inbox before polling transfers
_WAITING_S = 0.0005  # the same with no batch but requests waiting (KV in flight, pages short)
# aux rows (first tokens) beyond max_running_requests: the transfers of requests admitted while
# the batch is full hold rows too (admission bounds running + transferring by the same number,
# so this is slack for rows not yet returned by transfers that ended)
_AUX_SPARE_ROWS = 64
# the prealloc queue's KV deadline is a backstop only: the receiver times a transfer out first
# (kv_timeout_s) and returns its pages once the peer stopped writing (abort_quiesce_s)
_KV_BACKSTOP_MARGIN_S = 5.0
# speculation's start-up cost table: steps measured at this context, up to this many entries
_SPEC_CALIBRATE_CONTEXT = 512
_SPEC_CALIBRATE_MAX_ENTRIES = 1024


def _queue_limits(settings: Settings) -> QueueLimits:
    sched = settings.scheduler
    return QueueLimits(
        max_queued=sched.max_queued_requests, queue_timeout_s=sched.queue_timeout_s,
        kv_timeout_s=sched.kv_timeout_s + settings.transfer.abort_quiesce_s
        + _KV_BACKSTOP_MARGIN_S,
        max_active=sched.max_running_requests, decode_reserve_tokens=sched.decode_reserve_tokens,
        lookahead_tokens=settings.speculative.lookahead)


def _speculator(settings: Settings, rt: Runtime) -> Speculator | None:
    """Speculative decoding's drafter and policy (None when off), its cost table measured on
    this runner now: steps of 1, 2, 4, ... entries up to a full batch of verifies."""
    params = settings.speculative.params()
    if params is None:
        return None
    k, rows = params.num_draft_tokens, settings.scheduler.max_running_requests
    top = min(rows * (1 + k), _SPEC_CALIBRATE_MAX_ENTRIES)
    counts = sorted({1 << i for i in range(top.bit_length())} | {top})
    ctx = _SPEC_CALIBRATE_CONTEXT
    cost = StepCost(rt.runner.step_seconds(counts, ctx),
                    rt.runner.step_seconds(counts, ctx, group=1 + k))
    log.info("speculative decoding: %s, up to %d draft tokens; step cost by entries (plain / "
             "verify): %s",
             params.algorithm, k, ", ".join(
                 f"{n}: {cost(n) * 1e3:.2f} / {cost.verify(n) * 1e3:.2f} ms" for n in counts))
    return Speculator(make_drafter(params), k, cost)


def _plan(settings: Settings, rt: Runtime) -> HostPlan:
    """The host tier's size for a runtime built without one (logged here, not in the budget
    line)."""
    plan = plan_host_tier(settings.cache, rt.pools.page_bytes("full")
                          * rt.pools.spec.num_full_layers, rt.layout.num_full_pages,
                          rt.layout.page_size)
    log.info("%s", plan.describe())
    return plan


class DecodeEngine:
    """Build with `DecodeEngine.build`, then `start(outbox)`; talk to it through `inbox`."""

    def __init__(self, settings: Settings, rt: Runtime, metrics: Metrics,
                 outbox: Outbox | None = None) -> None:
        self.settings, self.rt = settings, rt
        c, sched = settings.cache, settings.scheduler
        self.page_size, self.window = rt.layout.page_size, rt.facts.window
        self.full = PageAllocator(rt.layout.num_full_pages, "full")
        self.swa = (PageAllocator(rt.layout.num_swa_pages, "swa")
                    if rt.facts.is_swa_hybrid else None)
        # a ZMQ publisher, or the gRPC port's SubscribeKvEvents, reads the tree's events
        events_on = c.decode_radix_cache and settings.kv_events.keeps_event_log(
            settings.server.grpc_port)
        self.host_tier = HostTier(rt.host_plan or _plan(settings, rt), rt.pools) if (
            host_tier_enabled(c)) else None
        ht = self.host_tier
        self.tree = (UnifiedRadixTree(self.page_size, self.window, self.full, self.swa,
                                      kv_events=events_on, host=ht.pages if ht else None,
                                      write_policy=ht.policy if ht else WritePolicy.WRITE_THROUGH)
                     if c.decode_radix_cache else None)
        if ht is not None and self.tree is not None:
            ht.attach(self.tree)
        self.kv_ctx = KVContext(self.tree, self.full, self.swa, page_size=self.page_size,
                                window=self.window, radix_cache=c.decode_radix_cache)
        self.stats = self.kv_ctx.stats
        self.queue = PreallocQueue(self.kv_ctx, _queue_limits(settings))
        decode_alloc = DecodeAllocator(self.kv_ctx)
        num_aux = sched.max_running_requests + _AUX_SPARE_ROWS
        aux, sglang_aux = AuxBuffer(num_aux), SglangAuxBuffers(num_aux)
        landing = rt.landing  # SGLang prefills of a model they lay out with all layers full
        self.receiver = ProtocolRouter(
            settings.transfer, model_compat(rt.runner, rt.model_name),
            region_layouts(rt.pools, aux),
            [(r.addr, row_bytes, num_aux) for r, row_bytes in sglang_aux.regions()],
            kv_timeout_s=sched.kv_timeout_s,
            landing=landing_region(landing) if landing is not None else None)
        sampler = Sampler(rt.pools.device)
        self.inbox = Inbox()
        batch = RunningBatch(rt.runner.new_inputs(sched.max_running_requests), decode_alloc,
                             sample_kind)
        self.fetcher = KVFetcher(
            self.receiver, AuxBuffers(aux, sglang_aux), self.kv_ctx, rt.runner, sampler,
            sglang_all_layers=rt.runner.model.cfg.sglang_ordinary,
            landing=LandingDock(landing, self.page_size) if landing is not None else None)
        self.spec = _speculator(settings, rt)
        self.table = RequestTable(self.kv_ctx, self.queue, decode_alloc, self.receiver,
                                  self.fetcher, outbox or Outbox.unbound(), batch,
                                  self.spec.ended if self.spec is not None else None,
                                  host_tier=self.host_tier,
                                  eos_ids=frozenset(rt.tokenizer.eos_token_ids),
                                  vocab_size=rt.runner.model.cfg.vocab_size)
        self.stepper = DecodeStepper(self.table, self.queue, decode_alloc, rt.runner, sampler,
                                     overlap=sched.overlap_schedule, spec=self.spec)
        self.books = Books(self.kv_ctx, self.table, self.receiver, self.stepper, metrics,
                           self.host_tier)
        # the one KV-event log: the ZMQ publisher and in-process (gRPC) subscribers read it
        self.kv_events = (KvEventHub(settings.kv_events.parsed.buffer_steps,
                                     load=lambda: self.books.load) if events_on else None)
        self._stopping = False
        self._next_integrity_check = 0.0
        self._thread: threading.Thread | None = None

    @classmethod
    def build(cls, settings: Settings, metrics: Metrics) -> DecodeEngine:
        return cls(settings, build_runtime(settings, use_cuda_graph=True, landing=True,
                                           host_tier=host_tier_enabled(settings.cache)), metrics)

    @property
    def tokenizer(self) -> Tokenizer:
        return self.rt.tokenizer

    @property
    def outbox(self) -> Outbox:
        return self.table.outbox

    @outbox.setter
    def outbox(self, outbox: Outbox) -> None:
        self.table.outbox = outbox

    @property
    def info(self) -> BackendInfo:
        return BackendInfo(
            model_path=str(self.rt.model_dir), served_model_name=self.rt.model_name,
            page_size=self.page_size, window=self.window,
            max_total_tokens=self.full.num_total * self.page_size,
            max_running_requests=self.settings.scheduler.max_running_requests,
            kv_full_bytes_per_token=(self.rt.pools.page_bytes("full")
                                     * self.rt.pools.spec.num_full_layers // self.page_size),
            context_length=self.rt.runner.model.cfg.max_position_embeddings)

    def host_tier_info(self) -> dict[str, Any]:
        """`/server_info`'s `host_tier`: its size and policy, and its pages and counters as the
        books last published them (safe to call from the event loop)."""
        ht = self.host_tier
        if ht is None:
            return {"enabled": False}
        return {"enabled": True, **ht.plan.info(), **self.books.host_live}

    # -- thread ------------------------------------------------------------------------------
    def start(self, outbox: Outbox) -> None:
        self.outbox = outbox
        self._thread = threading.Thread(target=self._run, name="decode-engine", daemon=True)
        self._thread.start()

    def join(self, timeout_s: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _run(self) -> None:
        try:
            while not self._stopping:
                self.step(time.monotonic())
        except Exception as exc:  # the loop boundary: anything here is fatal
            log.exception("decode engine failed; %s", self.books.snapshot())
            self.outbox.put(EngineDead(f"{type(exc).__name__}: {exc}"))
            self.outbox.flush()
        finally:
            self._close()

    def step(self, now: float) -> None:
        """inbox -> the table's step (commands, transfers, admission) -> start -> decode step
        (and commit) -> publish.

        With `scheduler.overlap_schedule` the decode step launches step N+1 and commits step N
        (see `stepper.py`), so everything before it runs while the device computes step N.

        Without a batch to run it blocks on the inbox first: `_WAITING_S` while requests wait
        (a transfer's end is polled, not signalled), `_IDLE_WAIT_S` when idle."""
        table = self.table
        busy = table.running or self.stepper.busy
        waiting = table.parked or self.queue.num_queued
        wait_s = 0.0 if busy else _WAITING_S if waiting else _IDLE_WAIT_S
        commands = self.inbox.get_all(wait_s)
        now = time.monotonic()  # the inbox wait may have blocked
        ready = table.step(now, commands)  # arrivals, cancels, poll, admission, fetch
        for cmd in commands:  # the engine's own, once the table polled
            if isinstance(cmd, FlushCache):
                self.outbox.put(CacheFlushed(cmd.token, self.books.flush_cache()))
            elif isinstance(cmd, Shutdown):
                self._stopping = True
        if self.host_tier is not None:
            self.host_tier.count_done_restores(now)
        self.stepper.step(now, ready)  # also commits a launched step (overlap)
        self.books.publish(now, decoding=bool(table.running))
        if self.kv_events is not None and self.tree is not None:
            self.kv_events.publish_step(self.tree)  # this step's events: one batch
        self._maybe_check_integrity(now)
        self.outbox.flush()

    def _maybe_check_integrity(self, now: float) -> None:
        """Between batches, every `integrity_check_interval_s`: pages and locks balance, or
        FatalError ends the engine (the supervisor restarts a worker whose books are wrong)."""
        interval = self.settings.scheduler.integrity_check_interval_s
        if (interval <= 0 or self.table.running or self.stepper.busy
                or now < self._next_integrity_check):
            return
        self._next_integrity_check = now + interval
        self.books.check_integrity()

    def _close(self) -> None:
        now = time.monotonic()
        for live in list(self.table.lives.values()):
            self.table.end(live, "drain", "aborted: drain", now)
        self.table.settle_all(now)  # nothing runs on the device any more
        self.outbox.flush()
        # CUDA graphs go before the pools' NIXL registration is released.
        self.rt.runner.destroy()
        self.receiver.close()
