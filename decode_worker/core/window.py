"""SWA window arithmetic and page counts (pure).

`window` everywhere here is the number of *earlier* tokens a query sees: Hugging Face
`sliding_window - 1` (127 for gpt-oss, whose `sliding_window` is 128). A query at position `q`
reads positions `[q - window, q]`.

Range map of one request at admission (`seq_len` tokens whose KV must be present; the next query
is at position `seq_len`):

```
pos:  0 ........... P .............. S .................. B ......... seq_len
      [ reused full prefix | full, transferred | full + SWA, transferred (the SWA tail) ]
      P = reused prefix (page-aligned)          B = align_down(seq_len) (insert boundary)
```
P may also lie past S (a long reused prefix and a short new message): then full KV arrives for
`[P, seq_len)` and SWA for `[S, seq_len)`, two ranges.
"""

from __future__ import annotations

import functools

from decode_worker.utils.mathx import align_down, cdiv


def swa_window_start(seq_len: int, window: int, page_size: int, radix_cache: bool) -> int:
    """Page-aligned SWA window start S for a request whose next query is at `seq_len`.

    `window`: earlier tokens a query sees (127 for gpt-oss; HF `sliding_window` 128).

    - radix cache on: `align_down(max(0, seq_len - 1 - max(window, page_size)))`
      (docs/CONTRACTS.md), lowered to `align_down(max(0, align_down(seq_len) - window))` where
      the contract formula alone would leave less than one window of live SWA below the insert
      boundary `B = align_down(seq_len)` (windows not of the form k*page_size - 1 or
      k*page_size; for gpt-oss the two agree). So the leaf the tree inserts at `B` covers >= one
      window and is matchable, and `S <= seq_len - window` (the next query sees its window).
    - radix cache off: `align_down(max(0, seq_len - window))`.

    Worked case: seq_len 895, page 64, window 127 -> 704 (tail 191 tokens, 3 pages).
    The same function gives the decode-time frontier: SWA below `swa_window_start(n)` is no
    longer read once the next query is at position `n`.
    """
    # (inline arithmetic: a decoding request's window slides through here once a page)
    if not radix_cache:
        x = seq_len - window
        return x - x % page_size if x > 0 else 0
    c = seq_len - 1 - (window if window > page_size else page_size)
    contract = c - c % page_size if c > 0 else 0
    m = seq_len - seq_len % page_size - window
    margin = m - m % page_size if m > 0 else 0
    return contract if contract < margin else margin


def swa_slide_at(target: int, window: int, page_size: int, radix_cache: bool) -> int:
    """The smallest `seq_len` whose `swa_window_start` is at least `target` (page-aligned, > 0):
    when a decoding request's SWA frontier next reaches `target`, so a scheduler checks one
    number per step instead of calling `swa_window_start`. Inverts both of its formulas:
    `align_down(s - 1 - max(window, page_size)) >= T` iff `s >= T + 1 + max(window, page_size)`,
    `align_down(align_down(s) - window) >= T` iff `s >= align_up(T + window)`; without the radix
    cache `align_down(s - window) >= T` iff `s >= T + window`."""
    if not radix_cache:
        return target + window
    return max(target + 1 + max(window, page_size), cdiv(target + window, page_size) * page_size)


def swa_tail_len(seq_len: int, window: int, page_size: int, radix_cache: bool) -> int:
    """Tokens in the SWA tail `[S, seq_len)` that are transferred fresh (see `swa_window_start`;
    `window` = earlier tokens a query sees, 127 for gpt-oss)."""
    return seq_len - swa_window_start(seq_len, window, page_size, radix_cache)


def swa_tail_pages(seq_len: int, window: int, page_size: int, radix_cache: bool) -> int:
    """SWA pages of the tail `[S, seq_len)`: S is page-aligned, so the tail rounds up."""
    return cdiv(swa_tail_len(seq_len, window, page_size, radix_cache), page_size)


def num_pages(num_tokens: int, page_size: int) -> int:
    """Pages that hold `num_tokens` tokens from position 0."""
    return cdiv(num_tokens, page_size)


def max_reuse_len(
    seq_len: int, window: int, page_size: int, radix_cache: bool, has_swa: bool
) -> int:
    """Longest prefix that may be reused from the tree for a request of `seq_len` tokens: the
    page-aligned `seq_len` (a full hit still receives the first output token), 0 without the
    radix cache. The reuse is of full-attention KV only and is not capped at the SWA window
    start S: the SWA tail `[S, seq_len)` arrives fresh, as a second range that may start inside
    the reused prefix. `window` = earlier tokens a query sees (127 for gpt-oss); `has_swa` is
    kept for callers that size both pools."""
    del window, has_swa  # the cap no longer depends on them
    if not radix_cache:
        return 0
    return align_down(seq_len, page_size)


def sglang_window_start(
    prefix_len: int, seq_len: int, window: int, prefill_page_size: int
) -> int:
    """The SWA window start an SGLang prefill sends from, given the decode side's reused prefix
    `prefix_len` (its `decode_prefix_len`): `max(prefix_len, seq_len - window)` rounded down to
    the prefill's page. `window` = earlier tokens a query sees (127 for gpt-oss)."""
    return align_down(max(prefix_len, seq_len - window, 0), prefill_page_size)


@functools.lru_cache(maxsize=64)
def swa_peak_pages(window: int, page_size: int, radix_cache: bool, lookahead: int = 0) -> int:
    """Most SWA pages one decoding request references at once, over its whole life (exact).

    While the next query is at `n` the request reads SWA for `[swa_window_start(n), n]`. With the
    radix cache, its prompt's window `[S, align_down(L))` passes to the tree at READY -> RUNNING
    and stays locked (referenced) until the frontier passes `align_down(L)`, so early on the
    span is `[S, n]`. Both are periodic in `L` and `n` with period `page_size` once past a few
    windows, so one period of prompt lengths is simulated. `window` = earlier tokens a query
    sees (127 for gpt-oss). `lookahead`: a step may write that many positions past `n` (its
    verified drafts), so their pages are held too.
    """
    ps, base, best = page_size, 4 * (window + page_size), 0
    for seq_len in range(base, base + ps):
        start = swa_window_start(seq_len, window, ps, radix_cache)
        locked_to = align_down(seq_len, ps) if radix_cache else 0
        for n in range(seq_len, seq_len + window + 3 * ps):  # past the lock's release
            frontier = swa_window_start(n, window, ps, radix_cache)
            lo = frontier if frontier >= locked_to else min(start, frontier)
            best = max(best, (n + lookahead) // ps - lo // ps + 1)
    return best


def max_full_pages(prompt_len: int, max_new_tokens: int, page_size: int) -> int:
    """Full pages a request needs at its longest: KV for the prompt and every output token but
    the last (the last sampled token is never fed back)."""
    return cdiv(prompt_len + max(max_new_tokens - 1, 0), page_size)
