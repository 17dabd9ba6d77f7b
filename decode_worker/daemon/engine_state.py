"""What the engine's parts share: the state `DecodeEngine` builds, declared once so that each
mixin (`engine_decode`, `engine_transfer`, `engine_pages`) is type-checked against it."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from decode_worker.core.admission import PreallocQueue
    from decode_worker.core.decode_alloc import DecodeAllocator
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

    def end(self, live: LiveRequest, to: RequestState, now: float, *, reason: str = "") -> None:
        """Terminal transition of `live` (defined by `DecodeEngine`)."""
        raise NotImplementedError

    def fail(self, live: LiveRequest, reason: str, message: str, now: float) -> None:
        """Fail `live` with `reason` (defined by `DecodeEngine`)."""
        raise NotImplementedError

    def plan_decode_pages(self, now: float) -> list[LiveRequest]:
        """Pages for the next decode step (defined by `engine_pages.PageOps`)."""
        raise NotImplementedError
