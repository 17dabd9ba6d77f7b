"""What the KV-side parts of one worker share: the tree, the two pools and their geometry (pure).

`PreallocQueue`, `DecodeAllocator` and the shell's terminal transitions take one `KVContext`;
it is also the `KVKeeper` every request transition uses. `window` = earlier tokens a query sees
(127 for gpt-oss, HF `sliding_window` 128).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from decode_worker.core.pages import PageAllocator
from decode_worker.core.radix_tree import UnifiedRadixTree
from decode_worker.core.req_kv import ReqKV
from decode_worker.core.stats import SchedulerStats
from decode_worker.core.window import max_reuse_len, swa_window_start
from decode_worker.errors import ConfigError


@dataclass(frozen=True, slots=True, eq=False)
class KVContext:
    """One worker's KV pools, its decode radix tree and their geometry; immutable wiring (the
    objects it names are mutable and owned by the compute thread).

    `tree` is None iff `radix_cache` is off (raises `ConfigError` otherwise); `swa` is None for a
    model without SWA layers. `stats` is the one counter record of the worker.
    """

    tree: UnifiedRadixTree | None
    full: PageAllocator
    swa: PageAllocator | None
    page_size: int
    window: int
    radix_cache: bool
    stats: SchedulerStats = field(default_factory=SchedulerStats)

    def __post_init__(self) -> None:
        if self.radix_cache != (self.tree is not None):
            raise ConfigError("KV context: a tree is needed iff the decode radix cache is on")

    def swa_start(self, seq_len: int) -> int:
        """Window start of a request whose next query is at `seq_len`; 0 without SWA layers."""
        if self.swa is None:
            return 0
        return swa_window_start(seq_len, self.window, self.page_size, self.radix_cache)

    def max_reuse_len(self, seq_len: int) -> int:
        """Longest prefix a request of `seq_len` tokens may reuse from the tree (0 without it)."""
        return max_reuse_len(
            seq_len, self.window, self.page_size, self.radix_cache, self.swa is not None
        )

    def evict_for(self, need_full: int, need_swa: int) -> str:
        """Evict from the tree for the exact page shortfall of each pool, the full pool first
        (counted in `stats`). Returns '' when the pools now hold the need, else the pool still
        short: "full" (then nothing is evicted from SWA) or "swa"."""
        tree, full, swa, st = self.tree, self.full, self.swa, self.stats
        if tree is not None and full.num_free < need_full:
            st.evicted_full_pages_total += len(tree.evict_full(need_full - full.num_free))
        if full.num_free < need_full:
            return "full"
        if swa is None:
            return ""
        if tree is not None and swa.num_free < need_swa:
            st.evicted_swa_pages_total += len(tree.evict_swa(need_swa - swa.num_free))
        return "swa" if swa.num_free < need_swa else ""

    def cache_unfinished(self, kv: ReqKV) -> None:
        """A request starts running: its received prompt enters the tree (dedup and repoint
        onto cache-owned pages), its lock moving onto it; nothing without a tree."""
        if self.tree is not None:
            self.tree.cache_unfinished_req(kv)

    def release(self, kv: ReqKV, *, insert: bool) -> None:
        """Give back everything `kv` holds: through the tree when there is one
        (`cache_finished_req`: with `insert` the tree keeps its page-aligned KV, valid KV only;
        then frees the rest and unlocks), else straight to the allocators (no decode radix
        cache: the request owns every page it references). Empties `kv`'s page tables."""
        if self.tree is not None:
            self.tree.cache_finished_req(kv, insert=insert)
            return
        self.full.free(kv.owned_full_page_ids(self.page_size))
        if self.swa is not None:
            self.swa.free(kv.owned_swa_page_ids(self.page_size))
        kv.full_page_ids = []
        kv.swa_page_ids = []
