"""SGLang's page-hash chain over the radix tree's pages, computed lazily (pure).

A page's digest is SHA-256 over the previous page's 32-byte digest (none for the first page
under the root) followed by the page's token ids as little-endian u32 (SGLang's
`mem_cache/utils.py::get_hash_str`); the published hash is the digest's first 8 bytes read
big-endian as a signed int64 (`hash_str_to_int64`).

The tree never hashes on the compute thread. An insert records one `PageRun`: the new pages'
keys (immutable bytes, never mutated after the run is made) and a reference to the page before
them (`PageRef`: a run and an index in it). A node holds a slice of one run (`run`, `run_at`);
a split or a trim only moves that slice, so every page keeps one identity for its life. The
digests are computed when a reader (the event publisher's thread, a gRPC stream, a test) first
asks for them, and memoised on the run. Runs are immutable but for that memo, which any thread
may fill: concurrent fills compute the same list and the assignment is atomic, so readers need
no lock.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from collections.abc import Sequence

_NATIVE_LE = sys.byteorder == "little"


def page_digest(prior: bytes | None, page_le_u32: bytes) -> bytes:
    """SGLang's `hash_page`: SHA-256 of the prior digest (if any), then the page's tokens."""
    return hashlib.sha256(prior + page_le_u32 if prior is not None else page_le_u32).digest()


def digest_to_int64(digest: bytes) -> int:
    """SGLang's `hash_str_to_int64`: the first 8 bytes, big-endian, signed."""
    return int.from_bytes(digest[:8], "big", signed=True)


def token_bytes(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian u32 (the hash input)."""
    return struct.pack(f"<{len(token_ids)}I", *token_ids)


def chain_hashes(
    token_ids: Sequence[int], page_size: int, prior: bytes | None = None
) -> list[int]:
    """Published hashes of `token_ids` cut into pages of `page_size` (a short last page is hashed
    as it is, as SGLang's `get_hash_str` does), chained from `prior`."""
    out: list[int] = []
    for i in range(0, len(token_ids), page_size):
        prior = page_digest(prior, token_bytes(token_ids[i : i + page_size]))
        out.append(digest_to_int64(prior))
    return out


def key_tokens(keys: Sequence[bytes | int], page_size: int) -> list[int]:
    """Token ids of page keys (`radix_node.page_keys`: native int32 bytes, or bare tokens)."""
    if page_size == 1:
        return [int(k) for k in keys]
    raw = b"".join(k for k in keys if isinstance(k, bytes))
    return list(struct.unpack(f"={len(raw) // 4}i", raw))


def key_le_u32(key: bytes | int) -> bytes:
    """One page key as the hash input (token ids are non-negative: int32 == u32)."""
    if isinstance(key, int):
        return key.to_bytes(4, "little")
    if _NATIVE_LE:
        return key
    n = len(key) // 4
    return struct.pack(f"<{n}i", *struct.unpack(f"={n}i", key))


def key_digests(prior: bytes | None, keys: Sequence[bytes | int]) -> list[bytes]:
    """Chained digests of the pages `keys` after `prior`."""
    out: list[bytes] = []
    sha = hashlib.sha256
    for key in keys:
        page = key if _NATIVE_LE and isinstance(key, bytes) else key_le_u32(key)
        prior = sha(prior + page if prior is not None else page).digest()
        out.append(prior)
    return out


class PageRun:
    """Pages inserted together: `keys` (never mutated), chained from page `parent_page` of run
    `parent` (None: under the root). `digests()` memoises their digests."""

    __slots__ = ("_digests", "keys", "parent", "parent_page")

    def __init__(self, keys: list[bytes | int], parent: PageRun | None, parent_page: int) -> None:
        self.keys = keys
        self.parent = parent
        self.parent_page = parent_page
        self._digests: list[bytes] | None = None

    def digests(self) -> list[bytes]:
        """The digest of every page of the run (computed once, with the runs above it)."""
        done = self._digests
        if done is not None:
            return done
        todo: list[PageRun] = []
        run: PageRun | None = self
        while run is not None and run._digests is None:  # iterative: chains are long
            todo.append(run)
            run = run.parent
        for run in reversed(todo):
            up = run.parent
            prior = None if up is None else up.digests()[run.parent_page]  # memoised above
            run._digests = key_digests(prior, run.keys)
        out = self._digests
        assert out is not None
        return out

    def __repr__(self) -> str:
        return f"PageRun(pages={len(self.keys)}, hashed={self._digests is not None})"


PageRef = tuple[PageRun, int]  # one page: a run and its index there


def page_before(run: PageRun, at: int) -> PageRef | None:
    """The page that page `at` of `run` chains from (None: it is under the root)."""
    if at > 0:
        return (run, at - 1)
    parent = run.parent
    return None if parent is None else (parent, run.parent_page)


def ref_digest(ref: PageRef | None) -> bytes | None:
    """The digest of page `ref` (None for None)."""
    return None if ref is None else ref[0].digests()[ref[1]]
