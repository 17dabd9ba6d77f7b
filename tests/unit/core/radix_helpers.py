"""Shared helpers of the radix tree unit tests (page size 4, window 7)."""

from __future__ import annotations

from decode_worker.core.pages import PageAllocator
from decode_worker.core.radix_tree import UnifiedRadixTree
from decode_worker.core.req_kv import ReqKV

PS, WIN = 4, 7


def make_tree(full: int = 64, swa: int | None = 32) -> UnifiedRadixTree:
    pools = PageAllocator(full, "full"), (PageAllocator(swa, "swa") if swa else None)
    return UnifiedRadixTree(PS, WIN, pools[0], pools[1])


def admit(tree: UnifiedRadixTree, tokens: list[int], swa_start: int) -> ReqKV:
    """A request holding fresh pages for all of `tokens`, live SWA from `swa_start`."""
    n_pages = -(-len(tokens) // PS)
    full = tree.full.alloc(n_pages)
    swa = [0] * (swa_start // PS)
    if tree.swa is not None:
        swa += tree.swa.alloc(n_pages - len(swa))
    return ReqKV(list(tokens), full, swa, swa_start=swa_start)


def held(tree: UnifiedRadixTree, *kvs: ReqKV) -> tuple[list[int], list[int]]:
    full = [p for kv in kvs for p in kv.owned_full_page_ids(PS)]
    swa = [p for kv in kvs for p in kv.owned_swa_page_ids(PS)]
    return full, swa


def check(tree: UnifiedRadixTree, *kvs: ReqKV) -> None:
    tree.check_integrity(*held(tree, *kvs))


def finish(tree: UnifiedRadixTree, tokens: list[int], swa_start: int) -> None:
    kv = admit(tree, tokens, swa_start)
    tree.cache_finished_req(kv)
    check(tree)
