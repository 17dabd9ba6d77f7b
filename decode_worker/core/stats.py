"""Plain counters kept by admission and the decode allocator; the daemon turns them into the
Prometheus metrics of docs/CONTRACTS.md (core never imports prometheus_client).

Counters only grow (`*_total`); gauges are read from the queue and the pools when scraped.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SchedulerStats:
    """Counters shared by `PreallocQueue` and `DecodeAllocator` (one instance per worker).

    - `prefix_query_tokens_total` / `prefix_hit_tokens_total`: per admitted request, the tokens
      it needed (`fill_len`) and those reused from the tree (`prefix_len`); a request blocked at
      the head of the queue is counted once, when admitted.
    - `aborts_total`: the aborts admission decides (`queue_full`, `too_large`, `queue_timeout`,
      `kv_timeout`, `swa_reclaim_insufficient`), by reason label; the shell counts the aborts
      it decides.
    - `evicted_*_pages_total`: pages the tree gave back on our asking (admission or decode).
    - `swa_pages_released_total`: request-owned SWA pages freed as the window moved on.
    """

    admission_passes_total: int = 0
    admissions_total: int = 0
    resumed_admissions_total: int = 0
    aborts_total: dict[str, int] = field(default_factory=dict)
    retractions_total: int = 0
    prefix_query_tokens_total: int = 0
    prefix_hit_tokens_total: int = 0
    evicted_full_pages_total: int = 0
    evicted_swa_pages_total: int = 0
    swa_pages_released_total: int = 0
    decode_pages_allocated_total: int = 0
    host_hit_tokens_total: int = 0  # of prefix_hit_tokens_total: restored from the host tier

    def count_admit(self, fill_len: int, prefix_len: int, *, resumed: bool) -> None:
        self.admissions_total += 1
        self.resumed_admissions_total += resumed
        self.prefix_query_tokens_total += fill_len
        self.prefix_hit_tokens_total += prefix_len

    def count_abort(self, reason: str) -> None:
        self.aborts_total[reason] = self.aborts_total.get(reason, 0) + 1


@dataclass(frozen=True, slots=True)
class QueueSizes:
    """Gauge snapshot the engine's books publish as `decode_worker_queue_requests{queue=...}`
    (prealloc = waiting for pages, transfer = holding pages while KV arrives, running = in the
    decode batch)."""

    prealloc: int
    transfer: int
    running: int
