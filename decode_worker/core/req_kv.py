"""One request's KV bookkeeping in page units (`ReqKV`), shared by the tree and admission."""

from __future__ import annotations

from dataclasses import dataclass, field

from decode_worker.core.radix_locks import LockRef
from decode_worker.core.radix_node import PageKey, page_keys


@dataclass(slots=True)
class ReqKV:
    """The pages one request holds, per logical page `i` (token positions `[i*ps, (i+1)*ps)`).

    ```
    token pos:  0 ........ cache_protected_len ........ swa_start ........ len(token_ids)
    full:       [ tree-owned (locked) | request-owned .............................. ]
    swa:        [ 0 (not held) ........................ | live SWA pages ............ ]
    ```
    A fresh SWA tail may also start inside the tree-owned full prefix (a transfer that reuses
    more full KV than the window start, `swa_start < cache_protected_len`):
    ```
    token pos:  0 ........ swa_start ........ cache_protected_len ........ len(token_ids)
    full:       [ tree-owned (locked) ............... | request-owned ............... ]
    swa:        [ 0 ........ | request-owned live SWA pages (swa_owned_from) ........ ]
    ```
    - `full_page_ids[i]` is always present for every page the request holds (it may hold pages
      past `cdiv(len(token_ids), ps)`, preallocated for decoding).
    - `swa_page_ids[i]` is an SWA-pool page or 0 (not held); pages below `swa_start // ps` are 0.
      Inside the tree-owned prefix an entry is the tree's SWA page, or 0 for a tombstone.
    - `swa_start` is page-aligned.
    - `cache_protected_len` is page-aligned: tokens `[0, this)` are owned by the tree and kept
      alive by `lock`; the request frees only pages at or past it.
    - `swa_owned_from` (page-aligned, or None = `cache_protected_len`): the request owns the
      live SWA entries at or past it; below it they are the tree's (or 0). It is below
      `cache_protected_len` only between admission and the first insert into the tree.
    - `page_keys` caches the page keys of `token_ids` (computed once, extended as tokens are
      appended; reset it if `token_ids` is ever rewritten other than by appending). Admission
      hands it the request's own list (`DecodeRequest.page_keys`): one cache per request.
    - `shares_tokens`: `token_ids` is the request's own prompt list (admission copies nothing:
      a 1,000-token copy per admission was most of a pass's cost, in the copy and in garbage
      collection of it); `request.StepCommit` copies it before the first decode step appends.
      Never mutate `token_ids` in place otherwise.
    """

    token_ids: list[int]
    full_page_ids: list[int]
    swa_page_ids: list[int]
    swa_start: int = 0
    cache_protected_len: int = 0
    lock: LockRef | None = field(default=None)
    page_keys: list[PageKey] = field(default_factory=list, repr=False)
    swa_owned_from: int | None = None
    shares_tokens: bool = False

    @property
    def seq_len(self) -> int:
        """Tokens whose KV the request holds."""
        return len(self.token_ids)

    def keys(self, page_size: int) -> list[PageKey]:
        """Page keys of the page-aligned prefix of `token_ids`, computing only new pages."""
        n = len(self.token_ids) // page_size
        have = len(self.page_keys)
        if have < n:
            self.page_keys += page_keys(self.token_ids[have * page_size : n * page_size], page_size)
        elif have > n:
            del self.page_keys[n:]
        return self.page_keys

    def owned_full_page_ids(self, page_size: int) -> list[int]:
        """Full pages the request owns (not the tree): those at or past the protected prefix."""
        return self.full_page_ids[self.cache_protected_len // page_size :]

    def swa_owned_len(self) -> int:
        """Token position from which the live SWA entries are the request's (see the class)."""
        own = self.swa_owned_from
        return self.cache_protected_len if own is None else min(own, self.cache_protected_len)

    def owned_swa_page_ids(self, page_size: int) -> list[int]:
        """Live SWA pages the request owns (not the tree)."""
        return [p for p in self.swa_page_ids[self.swa_owned_len() // page_size :] if p]
