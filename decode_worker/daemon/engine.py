"""The compute thread: owns torch, the pools, the tree, the prealloc queue and NIXL.

One step: commands -> transfer events -> admission -> deadlines -> ready requests join the
batch -> one decode step -> events out (one hand-off per step). Any exception in a step is a
broken invariant or a device failure: the engine posts `EngineDead` and stops, so the daemon
exits and its supervisor restarts it. Per-request problems never raise out of a step.
"""

from __future__ import annotations

import logging
import threading
import time

from decode_worker.core.admission import PreallocQueue, QueueLimits
from decode_worker.core.decode_alloc import DecodeAllocator
from decode_worker.core.kv_context import KVContext
from decode_worker.core.pages import PageAllocator
from decode_worker.core.radix_tree import UnifiedRadixTree
from decode_worker.core.request import RequestState
from decode_worker.core.stats import SchedulerStats
from decode_worker.daemon.bridge import (
    AbortRequest,
    AddRequest,
    CacheFlushed,
    Command,
    Drain,
    EngineDead,
    FinishRequest,
    FlushCache,
    Inbox,
    Outbox,
    Shutdown,
)
from decode_worker.daemon.decode_backend import BackendInfo
from decode_worker.daemon.engine_decode import DecodeOps
from decode_worker.daemon.engine_pages import PageOps
from decode_worker.daemon.engine_requests import RequestOps
from decode_worker.daemon.engine_transfer import TransferOps
from decode_worker.daemon.live import LiveRequest
from decode_worker.daemon.prefill_peer import model_compat, region_layouts
from decode_worker.daemon.runtime import Runtime, build_runtime
from decode_worker.device.aux_buffer import AuxBuffer
from decode_worker.device.sampler import Sampler
from decode_worker.device.tokenizer import Tokenizer
from decode_worker.io.kv_receiver import KVReceiver
from decode_worker.io.metrics import Metrics
from decode_worker.settings import Settings

log = logging.getLogger(__name__)
S = RequestState
_IDLE_WAIT_S = 0.02  # how long an idle engine blocks on its inbox before polling transfers
_WAITING_S = 0.0005  # the same with no batch but requests waiting (KV in flight, pages short)


class DecodeEngine(RequestOps, DecodeOps, TransferOps, PageOps):
    """Build with `DecodeEngine.build`, then `start(outbox)`; talk to it through `inbox`."""

    def __init__(self, settings: Settings, rt: Runtime, metrics: Metrics) -> None:
        self.settings, self.rt, self.metrics = settings, rt, metrics
        c, sched = settings.cache, settings.scheduler
        self.page_size = rt.layout.page_size
        self.window = rt.facts.window
        self.full = PageAllocator(rt.layout.num_full_pages, "full")
        self.swa = (PageAllocator(rt.layout.num_swa_pages, "swa")
                    if rt.facts.is_swa_hybrid else None)
        self.tree = (UnifiedRadixTree(self.page_size, self.window, self.full, self.swa)
                     if c.decode_radix_cache else None)
        self.stats = SchedulerStats()
        # one context for the queue, the decode allocator and the terminal transitions in `end`
        self.kv_ctx = KVContext(self.tree, self.full, self.swa, page_size=self.page_size,
                                window=self.window, radix_cache=c.decode_radix_cache,
                                stats=self.stats)
        quiesce = settings.transfer.abort_quiesce_s
        self.queue = PreallocQueue(self.kv_ctx, QueueLimits(
            max_queued=sched.max_queued_requests, queue_timeout_s=sched.queue_timeout_s,
            # backstop only: the receiver times transfers out first and returns pages
            # once the peer stopped writing
            kv_timeout_s=sched.kv_timeout_s + quiesce + 5.0,
            max_active=sched.max_running_requests,
            decode_reserve_tokens=sched.decode_reserve_tokens))
        self.decode_alloc = DecodeAllocator(self.kv_ctx)
        num_aux = sched.max_running_requests + 64
        self.aux = AuxBuffer(num_aux)
        self.aux_slots = list(range(num_aux - 1, -1, -1))
        self.receiver = KVReceiver(settings.transfer, model_compat(rt.runner, rt.model_name),
                                   region_layouts(rt.pools, self.aux), sched.kv_timeout_s)
        self.sampler = Sampler(rt.pools.device)
        self.inbox = Inbox()
        self.outbox: Outbox
        self.lives: dict[str, LiveRequest] = {}
        self.by_transfer: dict[int, LiveRequest] = {}
        self.running: list[LiveRequest] = []
        self.drain_deadline: float | None = None
        self._stopping = False
        self._next_integrity_check = 0.0
        self._thread: threading.Thread | None = None

    @classmethod
    def build(cls, settings: Settings, metrics: Metrics) -> DecodeEngine:
        return cls(settings, build_runtime(settings, use_cuda_graph=True), metrics)

    @property
    def tokenizer(self) -> Tokenizer:
        return self.rt.tokenizer

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
            log.exception("decode engine failed; %s", self.snapshot())
            self.outbox.put(EngineDead(f"{type(exc).__name__}: {exc}"))
            self.outbox.flush()
        finally:
            self._close()

    def step(self, now: float) -> None:
        """One iteration (see the module docstring). Without a batch to run it blocks on the
        inbox first: `_WAITING_S` while requests wait (a transfer's end is polled, not
        signalled), `_IDLE_WAIT_S` when idle."""
        waiting = self.by_transfer or self.queue.num_queued
        wait_s = 0.0 if self.running else _WAITING_S if waiting else _IDLE_WAIT_S
        for cmd in self.inbox.get_all(wait_s):
            self.handle(cmd, now)
        now = time.monotonic()  # the inbox wait may have blocked
        self.poll_transfers(now)
        self.admit(now)
        for ab in self.queue.expire(now):
            self._on_queue_abort(ab)
        self._check_drain(now)
        for live in [lv for lv in self.lives.values() if lv.req.state is S.READY]:
            self.start_ready(live, now)
        if self.running:
            self.decode_step(now)
        self.running = [lv for lv in self.running if lv.req.state is S.RUNNING]
        self.publish_gauges()
        self._maybe_check_integrity(now)
        self.outbox.flush()

    # -- commands ----------------------------------------------------------------------------
    def handle(self, cmd: Command, now: float) -> None:
        if isinstance(cmd, AddRequest):
            self.add(cmd, now)
        elif isinstance(cmd, AbortRequest | FinishRequest):
            live = self.lives.get(cmd.rid)
            if live is not None:
                reason = cmd.reason if isinstance(cmd, AbortRequest) else "stop"
                self.cancel(live, reason, now)
        elif isinstance(cmd, Drain):
            self.drain_deadline = now + cmd.grace_s
        elif isinstance(cmd, FlushCache):
            self.outbox.put(CacheFlushed(cmd.token, self.flush_cache()))
        elif isinstance(cmd, Shutdown):
            self._stopping = True

    def _maybe_check_integrity(self, now: float) -> None:
        """Between batches, every `integrity_check_interval_s`: pages and locks balance, or
        FatalError ends the engine (the supervisor restarts a worker whose books are wrong)."""
        interval = self.settings.scheduler.integrity_check_interval_s
        if interval <= 0 or self.running or now < self._next_integrity_check:
            return
        self._next_integrity_check = now + interval
        self.check_integrity()

    def _close(self) -> None:
        now = time.monotonic()
        for live in list(self.lives.values()):
            if live.transfer_id is not None:
                self.abort_transfer(live)
            self.cancel(live, "drain", now)
        self.outbox.flush()
        # CUDA graphs go before the pools' NIXL registration is released.
        self.rt.runner.destroy()
        self.receiver.close()

