"""The shared KV context: its wiring check and eviction for a page shortfall."""

from __future__ import annotations

import pytest

from decode_worker.core.kv_context import KVContext
from decode_worker.core.pages import PageAllocator
from decode_worker.core.radix_tree import MatchMode
from decode_worker.errors import ConfigError
from tests.unit.core.radix_helpers import PS, WIN, finish, make_tree


def _ctx(full_pages: int = 64, swa_pages: int = 32) -> KVContext:
    tree = make_tree(full_pages, swa_pages)
    return KVContext(tree, tree.full, tree.swa, page_size=PS, window=WIN, radix_cache=True)


def test_a_tree_is_needed_iff_the_radix_cache_is_on() -> None:
    tree = make_tree()
    with pytest.raises(ConfigError):
        KVContext(tree, tree.full, tree.swa, page_size=PS, window=WIN, radix_cache=False)
    with pytest.raises(ConfigError):
        KVContext(None, PageAllocator(8, "full"), None, page_size=PS, window=WIN,
                  radix_cache=True)


def test_evict_for_takes_the_exact_shortfall_from_the_tree() -> None:
    ctx = _ctx(full_pages=8)
    assert ctx.tree is not None
    finish(ctx.tree, list(range(32)), 0)  # 8 full pages cached, all evictable
    assert ctx.full.num_free == 0
    assert ctx.evict_for(3, 0) == ""
    assert ctx.full.num_free >= 3 and ctx.stats.evicted_full_pages_total >= 3


def test_evict_for_leaves_the_swa_pool_alone_while_the_full_pool_is_short() -> None:
    ctx = _ctx(full_pages=8)
    tree, swa = ctx.tree, ctx.swa
    assert tree is not None and swa is not None
    tokens = list(range(16))
    finish(tree, tokens, 0)
    lock = tree.lock(tree.match_prefix(tokens, MatchMode.TRANSFER).node, swa=False)
    ctx.full.alloc(ctx.full.num_free)  # nothing free and nothing evictable in the full pool
    assert tree.swa_stats().evictable > 0
    assert ctx.evict_for(1, swa.num_free + 1) == "full"
    assert ctx.stats.evicted_swa_pages_total == 0 and tree.swa_stats().evictable > 0
    tree.unlock(lock)


def test_evict_for_names_the_swa_pool_when_only_it_stays_short() -> None:
    ctx = _ctx(full_pages=8, swa_pages=4)
    assert ctx.swa is not None
    ctx.swa.alloc(3)
    assert ctx.evict_for(1, 2) == "swa"
    assert ctx.evict_for(1, 1) == ""
