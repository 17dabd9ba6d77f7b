"""What the engine's parts share: the state `DecodeEngine` builds, declared once so that each
mixin (`engine_requests`, `engine_decode`, `engine_transfer`, `engine_pages`) is type-checked
against it."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from decode_worker.core.admission import Admit, PreallocQueue
    from decode_worker.core.decode_alloc import DecodeAllocator
    from decode_worker.core.kv_context import KVContext
    from decode_worker.core.pages import PageAllocator
    from decode_worker.core.radix_tree import UnifiedRadixTree
    from decode_worker.core.request import RequestState
    from decode_worker.daemon.bridge import Outbox
    from decode_worker.daemon.live import LiveRequest
    from decode_worker.daemon.runtime import Runtime
    from decode_worker.device.aux_buffer import AuxBuffer
    from decode_worker.device.sampler import Sampler
    from decode_worker.io.kv_receiver import KVReceiver
    from decode_worker.io.metrics import Metrics


class EngineState:
    """Attributes set by `DecodeEngine.__init__`, and the engine methods the mixins call."""

    rt: Runtime
    metrics: Metrics
    page_size: int
    full: PageAllocator
    swa: PageAllocator | None
    tree: UnifiedRadixTree | None
    kv_ctx: KVContext
    queue: PreallocQueue
    decode_alloc: DecodeAllocator
    aux: AuxBuffer
    aux_slots: list[int]
    receiver: KVReceiver
    sampler: Sampler
    outbox: Outbox
    lives: dict[str, LiveRequest]
    by_transfer: dict[int, LiveRequest]
    running: list[LiveRequest]
    drain_deadline: float | None

    def end(self, live: LiveRequest, to: RequestState, now: float, *, reason: str = "") -> None:
        """Terminal transition of `live` (defined by `engine_requests.RequestOps`)."""
        raise NotImplementedError

    def fail(self, live: LiveRequest, reason: str, message: str, now: float) -> None:
        """Fail `live` with `reason` (defined by `engine_requests.RequestOps`)."""
        raise NotImplementedError

    def fetch_kv(self, live: LiveRequest, admit: Admit, now: float) -> None:
        """Get an admitted request's KV (defined by `engine_transfer.TransferOps`)."""
        raise NotImplementedError

    def abort_transfer(self, live: LiveRequest) -> None:
        """Stop waiting for `live`'s KV (defined by `engine_transfer.TransferOps`)."""
        raise NotImplementedError

    def plan_decode_pages(self, now: float) -> list[LiveRequest]:
        """Pages for the next decode step (defined by `engine_pages.PageOps`)."""
        raise NotImplementedError
