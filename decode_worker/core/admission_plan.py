"""How one admission reuses the tree and where its SWA comes from (pure): the native protocol's
plan and SGLang's. `window` = earlier tokens a query sees (127 for gpt-oss).

```
pos:  0 ........ swa_start ........ fresh_from ........ prefix ......... fill
full: [ tree's, locked ................................ | new pages ........ ]
swa:  [ 0 ...... | tree's live pages | new pages ................................ ]
```
(`fresh_from` may also lie at or past `prefix`, and `swa_start` past `prefix`: then nothing of
the tree's SWA is used.)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from decode_worker.core.kv_context import KVContext
from decode_worker.core.radix_locks import LockRef
from decode_worker.core.radix_node import PageKey
from decode_worker.core.radix_tree import MatchMode, MatchResult, UnifiedRadixTree
from decode_worker.core.req_kv import ReqKV
from decode_worker.core.request import DecodeRequest
from decode_worker.core.window import sglang_window_start
from decode_worker.utils.mathx import align_down, cdiv


@dataclass(slots=True)
class Reuse:
    """What one admission reuses from the tree and where its SWA comes from: the matched
    `prefix` (its full pages `full_ids`, held by `lock`), the request's page-aligned window start
    `swa_start`, the tree's live SWA pages `tree_swa` for `[swa_start, fresh_from)`, new SWA pages
    for `[fresh_from, fill)`, and `sent_start`, the SWA window start the peer is asked for.
    With a host tier, `prefix` (what the peer is told) = `device_prefix` (tree pages) + the host
    hits `host_ids` (locked by `lock`, restored into the first new full pages)."""

    prefix: int = 0
    device_prefix: int = 0
    host_ids: list[int] = field(default_factory=list)
    full_ids: list[int] = field(default_factory=list)
    lock: LockRef | None = None
    swa_start: int = 0
    tree_swa: list[int] = field(default_factory=list)
    fresh_from: int = 0
    sent_start: int = 0


def plan_native(ctx: KVContext, req: DecodeRequest, keys: list[PageKey]) -> Reuse:
    """Reuse every whole cached page of full KV. The SWA tail `[S, fill)` arrives fresh,
    except where the tree holds live SWA under the reused prefix: then the window starts at
    `max(S, P - one window of pages)` (still a valid window start: the insert boundary keeps
    one window above it) with the tree's pages, locked, and only `[P, fill)` arrives."""
    fill, tree, ps = req.fill_len, ctx.tree, ctx.page_size
    s = ctx.swa_start(fill)
    r = Reuse(swa_start=s, fresh_from=s, sent_start=s)
    cap = ctx.max_reuse_len(fill)
    if tree is None or cap <= 0:
        return r
    m = tree.match_prefix((), MatchMode.TRANSFER, cap, keys=keys)
    if m.total_len <= 0:
        return r
    if m.host_node is not None:  # host hits: the SWA tail arrives fresh
        _take_host(r, m, tree)
        return r
    p = r.prefix = r.device_prefix = m.prefix_len
    r.full_ids = m.full_page_ids
    start = max(s, p - cdiv(ctx.window, ps) * ps)  # what the prefix lock's SWA span covers
    live = m.swa_page_ids[start // ps : p // ps]
    if ctx.swa is None or not s < p < fill or not all(live):
        r.lock = tree.lock(m.node, swa=False)  # the SWA tail arrives fresh
        return r
    r.lock = tree.lock(m.node)  # full and the live SWA of one window above P
    r.swa_start, r.tree_swa, r.fresh_from, r.sent_start = start, live, p, p
    return r

def plan_sglang(ctx: KVContext, req: DecodeRequest, keys: list[PageKey]) -> Reuse:
    """SGLang's prefill sends SWA for `[floor(max(P, fill - window)), fill)` (its page): a
    `P` above `fill - window` is asked for only when the tree holds live SWA for
    `[fill - window, P)` (a RESUME match); else the reuse stops at the window's start and
    the whole window arrives fresh. `window` = earlier tokens a query sees (127).

    P stays below `fill` even when the tree holds the whole prompt (a retry of a prompt of
    whole pages): at `P = fill` SGLang 0.5.23's sender sends no SWA and no KV (its window
    `[fill, fill)` is empty), and its own decode never asks so (`_match_prefix_and_lock`
    caps the prefix at `fill - _swa_tail_len(fill)`). So the last page, full and SWA,
    arrives with the first token, as for any other hit."""
    fill, ps, tree = req.fill_len, ctx.page_size, ctx.tree
    low, top = max(fill - ctx.window, 0), align_down(fill - 1, ps)
    if tree is not None:
        m = tree.match_prefix((), MatchMode.RESUME, top, keys=keys)
        if m.prefix_len > low:  # live SWA of [low, P) in the tree: SWA arrives from P
            start = align_down(low, ps)
            return Reuse(m.prefix_len, m.prefix_len, [], m.full_page_ids, tree.lock(m.node),
                         start, m.swa_page_ids[start // ps :], m.prefix_len, m.prefix_len)
    r = Reuse()
    cap = min(align_down(low, ps), top) if ctx.radix_cache else 0
    if tree is not None and cap > 0:
        m = tree.match_prefix((), MatchMode.TRANSFER, cap, keys=keys)
        if m.total_len > 0:
            _take_host(r, m, tree)
    r.sent_start = sglang_window_start(r.prefix, fill, ctx.window, req.sglang_page_size)
    r.swa_start = r.fresh_from = align_down(r.sent_start, ps)
    return r


def _take_host(r: Reuse, m: MatchResult, tree: UnifiedRadixTree) -> None:
    """Reuse the device hits and the host hits of `m` (locked now, so that nothing promised to
    the peer can be host-evicted before it is restored); the SWA tail arrives fresh."""
    r.prefix, r.device_prefix = m.total_len, m.prefix_len
    r.full_ids, r.host_ids = m.full_page_ids, m.host_page_ids
    r.lock = tree.lock(m.host_node or m.node, swa=False)


def reserved_kv(ctx: KVContext, req: DecodeRequest, r: Reuse, keys: list[PageKey],
                new_full: list[int], new_swa: list[int]) -> ReqKV:
    """The `ReqKV` of an admission by plan `r` with the new pages: the reused prefix (locked)
    then `new_full`; SWA 0 below the window start, the tree's live pages, then `new_swa`. Its
    tokens are the prompt itself while that is the whole fill (`ReqKV.shares_tokens`: no copy)
    and its keys the request's own cached list: both are the keys of the same growing token
    sequence (`fill_ids` is `kv.token_ids`), so they are cached once and extended by either."""
    ps = ctx.page_size
    swa_ids = [0] * (r.swa_start // ps) + r.tree_swa + new_swa if ctx.swa is not None else []
    tokens, shared = req.kv_tokens()
    kv = ReqKV(tokens, r.full_ids + new_full, swa_ids, r.swa_start, r.device_prefix, r.lock,
               keys, shares_tokens=shared)
    if ctx.swa is not None and r.fresh_from < r.device_prefix:  # the tail starts in the prefix
        kv.swa_owned_from = r.fresh_from
    return kv
