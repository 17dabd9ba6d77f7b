"""A device-time stand-in for the decode stepper: test and benchmark only, never the daemon.

`FakeDeviceRunner` keeps the real persistent inputs (`DecodeInputs`: page tables, future token
ids) and the real host-side work of a step (queued row writes flushed, inputs staged), but its
"forward" is a cheap fixed function of (input token, position, current full page) and takes
`device_ms` of simulated device time without holding the host: a launch only books the simulated
device (a queue: a step starts when the previous one is done), and `wait()` on the step's tokens
spins until the booked end, as `cudaEventSynchronize` does by default (a thread that sleeps
instead wakes up slower on a VM). So host work done between a launch and the wait overlaps the
device time, as on a GPU. What the forward computes (table gathers, the token function, the
logits) is device work on a GPU; here the CPU does it, so its CPU time is booked as the
device's (`compute_cpu_s`), not the host's, and the vocabulary is small (64) so that the
stepper's argmax over the logits, a kernel launch on a GPU, stays small too.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from decode_worker.core.admission import PreallocQueue, QueueLimits
from decode_worker.core.decode_alloc import DecodeAllocator
from decode_worker.core.kv_context import KVContext
from decode_worker.core.pages import PageAllocator
from decode_worker.core.req_kv import ReqKV
from decode_worker.core.request import RequestState
from decode_worker.core.sampling import SamplingParams
from decode_worker.daemon.decode.batch import RunningBatch
from decode_worker.daemon.decode.bridge import AddRequest, Event, Outbox
from decode_worker.daemon.decode.fetcher import AuxBuffers, KVFetcher
from decode_worker.daemon.decode.requests import RequestTable
from decode_worker.daemon.decode.stepper import DecodeStepper, sample_kind
from decode_worker.device.aux_buffer import AuxBuffer
from decode_worker.device.decode_inputs import DecodeInputs, HostTokens
from decode_worker.device.sampler import Sampler
from decode_worker.device.sglang_aux import SglangAuxBuffers
from decode_worker.io.kv.peer import ReceiverStats, TransferEvent
from decode_worker.utils.mathx import cdiv

CPU = torch.device("cpu")


class FakeHostTokens(HostTokens):
    """Token ids ready at `ready_at` (perf_counter seconds) on the simulated device."""

    def __init__(self, chosen: torch.Tensor, runner: FakeDeviceRunner, ready_at: float,
                 extras: tuple[torch.Tensor, ...] = ()) -> None:
        super().__init__(chosen, extras)
        self._runner, self._ready_at = runner, ready_at

    def wait_array(self) -> np.ndarray:
        t0, cpu0 = time.perf_counter(), time.thread_time()
        while time.perf_counter() < self._ready_at:  # spin, like a CUDA event synchronize
            pass
        self._runner.wait_s += time.perf_counter() - t0
        self._runner.wait_cpu_s += time.thread_time() - cpu0
        return super().wait_array()


class FakeDeviceRunner:
    """A `DecodeRunner` whose step takes `device_ms` of simulated device time. Its "model"
    picks (31 * token + 7 * position + page) % vocab, `page` the page id at the position (a
    GPU's table gathers); `read_pages=False` drops the page term, so the tokens do not depend
    on which pages a request was given (runs that allocate in another order agree)."""

    def __init__(self, device_ms: float, *, vocab: int = 64, page_size: int = 16,
                 window: int = 127, max_pages: int = 4096,
                 pool_pages: tuple[int, int] = (1 << 20, 1 << 20), lookahead: int = 0,
                 read_pages: bool = True) -> None:
        self.device_s, self.vocab, self.lookahead = device_ms / 1e3, vocab, lookahead
        self.read_pages = read_pages
        self.page_size, self.window, self.max_pages = page_size, window, max_pages
        self.pool_pages = pool_pages
        self.free_at = 0.0  # perf_counter time the simulated device finishes its queue
        self.wait_s = 0.0  # host time spent blocked on the simulated device
        self.wait_cpu_s = 0.0  # the CPU time of that (the spin at its end)
        self.compute_cpu_s = 0.0  # CPU time of the forward's math (device work on a GPU)
        self.steps = 0

    def new_inputs(self, num_rows: int) -> DecodeInputs:
        return DecodeInputs(num_rows, self.max_pages, self.window + self.lookahead,
                            self.page_size, self.pool_pages, CPU)

    def decode_rows(self, inputs: DecodeInputs, rows: Sequence[int] | np.ndarray,
                    positions: Sequence[int] | np.ndarray,
                    drafts: tuple[np.ndarray, np.ndarray] | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """logits [bs, vocab]: one-hot at (31 * token + 7 * position + page) % vocab. Reads
        only the inputs' current page (on a GPU the table gathers are device work)."""
        inputs.flush()
        bs = len(rows)
        both = inputs.to_device(np.concatenate((np.asarray(rows, np.int64),
                                               np.asarray(positions, np.int64))))  # [2 * bs]
        rows_t, pos_t = both[:bs], both[bs:]  # [bs] each
        cpu0 = time.thread_time()
        page = inputs.full[rows_t, pos_t // self.page_size].long()  # [bs]
        page = page if self.read_pages else page * 0
        tokens = inputs.tokens[rows_t]  # [bs]
        if drafts is not None:  # a verify step's draft entries take their tokens from the host
            tokens[torch.from_numpy(drafts[0])] = torch.from_numpy(drafts[1])
        nxt = (31 * tokens + 7 * pos_t + page) % self.vocab  # [bs]
        logits = torch.zeros(bs, self.vocab)  # [bs, V]
        logits[torch.arange(bs), nxt] = 1.0
        self.compute_cpu_s += time.thread_time() - cpu0
        now = time.perf_counter()
        self.free_at = max(now, self.free_at) + self.device_s
        self.steps += 1
        return logits, rows_t

    def fetch_tokens(self, chosen: torch.Tensor, extras: tuple[torch.Tensor, ...] = ()
                     ) -> HostTokens:
        return FakeHostTokens(chosen, self, self.free_at, extras)


class SinkOutbox(Outbox):
    """An outbox that keeps the events in `events` (or only counts them)."""

    def __init__(self, keep: bool = False) -> None:
        super().__init__(None, lambda events: None)
        self.keep, self.num_events = keep, 0
        self.events: list[Event] = []

    def put(self, event: Event) -> None:
        self.num_events += 1
        if self.keep:
            self.events.append(event)


class FakeIdleReceiver:
    """The KV receiver (NIXL) of a worker with no transfer in flight and no peer known: what
    a `KVFetcher` and the engine's books read of it."""

    def __init__(self) -> None:
        self.stats = ReceiverStats()

    def take_events(self) -> list[TransferEvent]:
        return []

    def peers_by_protocol(self) -> dict[str, int]:
        return {}


class _NoTransfers:
    """No request of `running_stepper` has a transfer or a prefill peer."""

    def abort_transfer(self, transfer_id: int) -> None:
        pass

    def cancel_room(self, host: str, port: int, room: int, reason: str, detail: str) -> None:
        pass


def running_stepper(runner: Any, bs: int, ctx: int, overlap: bool, *, page_size: int = 16,
                    window: int = 127,
                    params: SamplingParams | list[SamplingParams] | None = None,
                    keep_events: bool = False, stagger: bool = True,
                    logprobs: list[tuple[bool, int]] | None = None,
                    tree: Any = None, spec: Any = None) -> DecodeStepper:
    """The daemon's `DecodeStepper` over `runner` with `bs` RUNNING requests of `ctx` prompt
    tokens each (pages from real allocators, no radix tree, no transfer): what the step costs
    without admission and KV transfer in the way. With `stagger` request i's prompt is
    `i % page_size` tokens shorter, so page edges spread over the steps as in a real batch
    (not every request at an edge on the same step). `logprobs`: per request, whether it
    wants its tokens' logprobs and how many alternatives. `tree`: a callable
    `(full, swa) -> UnifiedRadixTree` to run with the decode radix cache on (each prompt is
    inserted as its request starts). `spec`: a `Speculator` (speculative decoding on)."""
    num_full = bs * (cdiv(ctx, page_size) + 64) + 8
    full, swa = PageAllocator(num_full, "full"), PageAllocator(bs * 16 + 8, "swa")
    radix = tree(full, swa) if tree is not None else None
    kv_ctx = KVContext(radix, full, swa, page_size=page_size, window=window,
                       radix_cache=radix is not None)
    queue = PreallocQueue(kv_ctx, QueueLimits(max_queued=bs, queue_timeout_s=1e9,
                                              kv_timeout_s=1e9, max_active=bs,
                                              decode_reserve_tokens=0))
    alloc = DecodeAllocator(kv_ctx)
    batch = RunningBatch(runner.new_inputs(bs), alloc, sample_kind)
    sampler = Sampler("cpu", seed=0)
    fetcher = KVFetcher(FakeIdleReceiver(), AuxBuffers(AuxBuffer(1), SglangAuxBuffers(1)),  # type: ignore[arg-type]
                        kv_ctx, runner, sampler)
    table = RequestTable(kv_ctx, queue, alloc, _NoTransfers(), fetcher, SinkOutbox(keep_events),
                         batch, spec.ended if spec is not None else None)
    stepper = DecodeStepper(table, queue, alloc, runner, sampler, overlap=overlap, spec=spec)
    params = params or SamplingParams(max_new_tokens=1 << 20, temperature=0, ignore_eos=True)
    per_req = params if isinstance(params, list) else [params] * bs
    for i in range(bs):
        n_tok = ctx - i % page_size if stagger else ctx
        prompt = [(i * 7 + j) % 200 + 3 for j in range(n_tok)]
        lp, top = logprobs[i] if logprobs else (False, 0)
        live = table.register(AddRequest(f"r{i}", prompt, per_req[i], lp, None, None, None,
                                         0.0, top_logprobs=top))
        swa_start, n = kv_ctx.swa_start(n_tok), cdiv(n_tok, page_size)
        swa_ids = [0] * (swa_start // page_size) + swa.alloc(n - swa_start // page_size)
        kv = ReqKV(list(prompt), full.alloc(n), swa_ids, swa_start=swa_start)
        live.req.transition(RequestState.RESERVED, 0.0, kv=kv)
        live.req.transition(RequestState.READY, 0.0, first_token=5 + i % 200)
        if lp or top:  # as the fetcher does with the prefill peer's first token
            live.record_logprobs(-1.0, [(5 + i % 200, -1.0)] * top)
        stepper.start(live, 0.0)
    return stepper
