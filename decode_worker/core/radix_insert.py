"""Insertion into the unified radix tree: dedup against cached pages, tombstone healing, new
leaves with the tombstone/live split and the one-window leaf cap."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise

from decode_worker.core.radix_base import changes_tree
from decode_worker.core.radix_host import HostOps
from decode_worker.core.radix_node import Node, PageKey, common_pages
from decode_worker.errors import PageError
from decode_worker.utils.mathx import cdiv


class InsertOps(HostOps):
    """`insert` and its helpers (mixed into `UnifiedRadixTree`)."""

    def insert(
        self,
        token_ids: Sequence[int],
        full_page_ids: Sequence[int],
        swa_page_ids: Sequence[int],
        swa_start: int,
        protected_len: int = 0,
        *,
        keys: Sequence[PageKey] | None = None,
        swa_owned_len: int | None = None,
    ) -> int:
        """Insert the page-aligned prefix of `token_ids`; returns the length already present.

        Ownership: pages of the first `protected_len` tokens are the tree's already. The caller's
        pages at or past `protected_len` (within the aligned length) pass to the tree: new ones are
        stored, duplicates of cached pages are freed, a tombstone whose range the caller holds live
        SWA for is healed with the caller's SWA pages. The caller's SWA pages start at
        `swa_owned_len` (default `protected_len`; lower when a fresh SWA tail starts inside the
        tree-owned full prefix): there it may heal tombstones, and duplicates of live tree SWA are
        freed. SWA pages in `[swa_owned_len, swa_start)` must be 0. Pages past the aligned length
        are untouched (still the caller's).
        Raises `PageError` (tree unchanged) on short page lists or bad page ids."""
        ks = self._keys(token_ids, keys)
        prefix, _ = self._insert(ks, full_page_ids, swa_page_ids, swa_start, protected_len,
                                 swa_owned_len)
        return prefix * self.page_size

    @changes_tree
    def _insert(
        self,
        keys: list[PageKey],
        full_ids: Sequence[int],
        swa_ids: Sequence[int],
        swa_start: int,
        protected_len: int,
        swa_owned_len: int | None = None,
    ) -> tuple[int, Node]:
        """Insert; returns (pages already present, the node ending at the aligned end)."""
        ps, n = self.page_size, len(keys)
        prot = protected_len // ps
        sprot = prot if swa_owned_len is None else min(prot, swa_owned_len // ps)
        live_from = max(cdiv(swa_start, ps), sprot)
        if self.swa is not None and len(swa_ids) < min(n, live_from):
            swa_ids = [*swa_ids, *[0] * (live_from - len(swa_ids))]  # short list: not held
        if not self.full.all_held(full_ids[prot:n]):
            raise PageError("insert: a full page id is not allocated")
        self._validate_insert(n, full_ids, swa_ids, sprot, live_from)
        self._tick += 1
        node, i, path = self.root, 0, []
        free_full: list[int] = []
        free_swa: list[int] = []
        while i < n:
            child = node.children.get(keys[i])
            if child is None:
                break
            ck = child.key
            m = len(ck)
            if i + m > n or (m > 1 and ck != keys[i : i + m]):  # not the whole node: split
                m = common_pages(ck, keys, i, n)
                child = self._split(child, m)
            child = self._absorb(child, i, full_ids, swa_ids, (prot, sprot, live_from),
                                 free_full, free_swa)
            path.append(child)
            node, i = child, i + m
        if prot > i:
            raise PageError(f"insert: protected_len {protected_len} beyond the cached prefix")
        if i < n:
            path.extend(self._add_leaves(node, keys, i, full_ids, swa_ids, live_from))
        self._touch(path)
        self.full.free(free_full)
        if free_swa and self.swa is not None:
            self.swa.free(free_swa)
        end_node = path[-1] if path else self.root
        self._write_on_insert(end_node)
        return i, end_node

    def _validate_insert(
        self, n: int, full_ids: Sequence[int], swa_ids: Sequence[int], sprot: int, live_from: int
    ) -> None:
        """Check the caller's pages (full past the protected prefix, SWA past `sprot`) before
        anything changes."""
        if len(full_ids) < n or (self.swa is not None and len(swa_ids) < n):
            raise PageError(f"insert: {n} pages of key but {len(full_ids)} full page ids")
        if self.swa is None:
            return
        if any(swa_ids[sprot:live_from]):
            raise PageError("insert: a live SWA page below the window start")
        if not self.swa.all_held(swa_ids[live_from:n]):
            raise PageError("insert: an SWA page id in the window is missing or not allocated")

    def _absorb(
        self,
        node: Node,
        i: int,
        full_ids: Sequence[int],
        swa_ids: Sequence[int],
        bounds: tuple[int, int, int],
        free_full: list[int],
        free_swa: list[int],
    ) -> Node:
        """The caller's pages over an existing node covering pages `[i, i+len)`: queue duplicate
        frees (full past `prot`, SWA past `sprot`), heal a tombstone where the caller holds live
        SWA (splitting off a tombstone upper part if the live range starts inside). `bounds` is
        (prot, sprot, live_from). Returns the node ending at `i + len`."""
        prot, sprot, live_from = bounds
        end = i + len(node.key)
        lo = max(i, prot)
        if node.full is None:  # host-only: the caller's pages (restored KV) bring it back
            if i < prot:
                raise PageError("insert: the protected prefix reaches a host-only node")
            self._promote(node, list(full_ids[i:end]))
        elif lo < end:  # the caller owns pages here: the ones that differ are duplicates
            free_full += _differing(full_ids[lo:end], node.full[lo - i :])
        if self.swa is None:
            return node
        slo = max(i, sprot)
        if node.swa is not None:
            if slo < end:
                free_swa += [p for p in _differing(swa_ids[slo:end], node.swa[slo - i :]) if p]
        elif live_from < end:
            if live_from > i:
                self._split(node, live_from - i)  # `node` stays the lower part
            node.swa = list(swa_ids[max(i, live_from) : end])
            node.swa_epoch = self._tick
            self.ledger.swa_add(node)
            self.ledger.swa_evictable += len(node.key)
        return node

    def _add_leaves(
        self,
        parent: Node,
        keys: list[PageKey],
        i: int,
        full_ids: Sequence[int],
        swa_ids: Sequence[int],
        live_from: int,
    ) -> list[Node]:
        """New nodes for pages `[i, n)` below `parent`: a tombstone part below `live_from`, a live
        part above it. A live part longer than two page-aligned windows is split so that the leaf
        holds one window: a lock then pins about one window of SWA, not the whole run."""
        n = len(keys)
        cuts = [i]
        if self.swa is not None:
            t = min(max(live_from, i), n)
            if i < t < n:
                cuts.append(t)
            if t < n and n - t > 2 * self._window_pages:  # a long live run: cap the leaf
                cuts.append(n - self._window_pages)
        cuts.append(n)
        new: list[Node] = []
        ledger, tick, events = self.ledger, self._tick, self.events
        run = events.new_run(keys[i:n], parent.tail_page())  # no hashing here (lazy)
        events.stored(run, 0, n - i)
        ledger.discard_leaf(parent)
        for a, b in pairwise(cuts):
            live = self.swa is not None and a >= live_from
            node = Node(
                parent, keys[a:b], list(full_ids[a:b]), list(swa_ids[a:b]) if live else None, tick
            )
            node.run, node.run_at = run, a - i
            parent.children[keys[a]] = node
            if live:
                ledger.swa_add(node)
                ledger.swa_evictable += b - a
            new.append(node)
            parent = node
        ledger.full_evictable += n - i
        ledger.add_leaf(parent)
        return new


def _differing(mine: Sequence[int], theirs: list[int]) -> list[int]:
    """Entries of `mine` that differ from `theirs` at the same index (C-speed when all or none)."""
    if mine == theirs:
        return []
    return [p for p, q in zip(mine, theirs, strict=True) if p != q]
