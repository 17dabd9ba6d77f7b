"""A CUDA card's memory as `device/gpu_memory.DeviceMemory` sees it, for tests on CPU.

`FakeCard` is one device shared by processes; `FakeCard.process()` is one process on it (its
context charged at once, like a CUDA context at first contact). `alloc` and `free` stand for
what torch's caching allocator reserves; allocating past the card's free memory raises
`FakeOutOfMemory`, as a CUDA allocation would.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from decode_worker.core.memory_budget import CONTEXT_BYTES


class FakeOutOfMemory(RuntimeError):
    pass


@dataclass
class FakeCard:
    total_bytes: int
    procs: list[FakeProcessMemory] = field(default_factory=list)

    @property
    def used_bytes(self) -> int:
        return sum(CONTEXT_BYTES + p.held for p in self.procs)

    def process(self) -> FakeProcessMemory:
        if self.used_bytes + CONTEXT_BYTES > self.total_bytes:
            raise FakeOutOfMemory("no room for a context")
        proc = FakeProcessMemory(self)
        self.procs.append(proc)
        return proc


@dataclass
class FakeProcessMemory:
    card: FakeCard
    held: int = 0
    peak: int = 0
    cached: int = 0  # freed but kept by the allocator until release_cached

    def alloc(self, n: int) -> None:
        reuse = min(n, self.cached)
        self.cached -= reuse
        if n - reuse > self.card.total_bytes - self.card.used_bytes:
            raise FakeOutOfMemory(f"cannot allocate {n} bytes")
        self.held += n - reuse
        self.peak = max(self.peak, self.held)

    def free(self, n: int) -> None:
        self.cached += n  # the caching allocator keeps it

    def mem_get_info(self) -> tuple[int, int]:
        return self.card.total_bytes - self.card.used_bytes, self.card.total_bytes

    def held_bytes(self) -> int:
        return self.held

    def peak_held_bytes(self) -> int:
        return self.peak

    def reset_peak(self) -> None:
        self.peak = self.held

    def release_cached(self) -> None:
        self.held -= self.cached
        self.cached = 0
