"""KV events of the radix tree's full-attention pages, as SGLang's tree records them (pure).

The tree reports what its full-attention pages do, page by page, so that a consumer applying the
events in order holds exactly the pages the worker could reuse:

- `BlockStored`: pages entered the tree (a new leaf, or a host-tier page promoted back);
- `BlockRemoved`: pages left a medium (device eviction, including a leaf trimmed page by page,
  or a demotion to the host tier, which is a removal from `GPU` plus a store in `CPU_PINNED`);
- `AllBlocksCleared`: the tree is empty (cache flush).

SWA-only changes (tombstones) are silent: a tombstone keeps the full KV, which TRANSFER matches
still reuse. Node splits are silent too: both halves keep their page hashes.

Page identity is SGLang's page chain (`page_chain`). The compute thread only records which
pages an event names (slices of `PageRun`s, O(1) per event); the hashes, the parent hash and
the token ids are computed when a reader first asks for them (`block_hashes`, `token_ids`,
`parent_block_hash`: the publisher's thread, a gRPC stream), and memoised. Pages are immutable,
so a removal read long after the page left still names it exactly.

The records are plain data; the shell encodes them (msgpack, gRPC). The recorder is not
thread-safe: the compute thread records and takes; what `take` returns is never touched again
by the recorder, and any thread may read it.
"""

from __future__ import annotations

from typing import Any, Union

from decode_worker.core.page_chain import (
    PageRef,
    PageRun,
    chain_hashes,
    digest_to_int64,
    key_le_u32,
    key_tokens,
    page_before,
    page_digest,
    ref_digest,
    token_bytes,
)

__all__ = [  # the hash helpers stay importable from here
    "MEDIUM_CPU_PINNED", "MEDIUM_GPU", "AllBlocksCleared", "BlockRemoved", "BlockStored",
    "KVEvent", "KVEventRecorder", "Pages", "chain_hashes", "digest_to_int64", "key_le_u32",
    "key_tokens", "page_digest", "token_bytes",
]

MEDIUM_GPU = "GPU"
MEDIUM_CPU_PINNED = "CPU_PINNED"
Pages = tuple[PageRun, int, int]  # pages [start, end) of a run


def _int64_of(ref: PageRef | None) -> int | None:
    digest = ref_digest(ref)
    return None if digest is None else digest_to_int64(digest)


class BlockStored:
    """Pages stored, in chain order: `block_hashes[i]` names `token_ids[i*block_size:
    (i+1)*block_size]`; the first page chains from `parent_block_hash` (None: under the root).
    Built with values, or by the recorder from pages (`of_pages`: values computed on first read).
    Compares by value."""

    __slots__ = ("_hashes", "_pages", "_parent", "_tokens", "block_size", "lora_id", "medium")

    def __init__(self, block_hashes: list[int], parent_block_hash: int | None,
                 token_ids: list[int], block_size: int, medium: str = MEDIUM_GPU,
                 lora_id: int | None = None) -> None:
        self._parent, self._tokens = parent_block_hash, token_ids
        self._hashes: list[int] | None = block_hashes
        self._pages: list[Pages] = []
        self.block_size, self.medium, self.lora_id = block_size, medium, lora_id

    @classmethod
    def of_pages(cls, pages: list[Pages], block_size: int, medium: str) -> BlockStored:
        """The store of `pages` (consecutive in the chain), resolved lazily."""
        self = cls.__new__(cls)  # the compute thread's path: no values to set yet
        self._hashes, self._pages, self._parent, self._tokens = None, pages, None, []
        self.block_size, self.medium, self.lora_id = block_size, medium, None
        return self

    @property
    def block_hashes(self) -> list[int]:
        hashes = self._hashes
        return hashes if hashes is not None else self._resolve()

    @property
    def parent_block_hash(self) -> int | None:
        if self._hashes is None:
            self._resolve()
        return self._parent

    @property
    def token_ids(self) -> list[int]:
        if self._hashes is None:
            self._resolve()
        return self._tokens

    def _resolve(self) -> list[int]:
        """Compute the values from the pages (any thread; `_hashes` is written last, so a
        reader that sees it sees the others)."""
        pages, ps = self._pages, self.block_size
        hashes: list[int] = []
        tokens: list[int] = []
        for run, start, end in pages:
            hashes += [digest_to_int64(d) for d in run.digests()[start:end]]
            tokens += key_tokens(run.keys[start:end], ps)
        self._parent = _int64_of(page_before(pages[0][0], pages[0][1]))
        self._tokens = tokens
        self._hashes = hashes
        return hashes

    def _values(self) -> tuple[Any, ...]:
        return (self.block_hashes, self.parent_block_hash, self.token_ids, self.block_size,
                self.medium, self.lora_id)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, BlockStored):
            return NotImplemented
        return self._values() == other._values()

    __hash__ = None  # type: ignore[assignment]  # mutable lists inside, as the dataclass was

    def __repr__(self) -> str:
        h, p, t, bs, m, lora = self._values()
        return (f"BlockStored(block_hashes={h!r}, parent_block_hash={p!r}, token_ids={t!r}, "
                f"block_size={bs!r}, medium={m!r}, lora_id={lora!r})")


class BlockRemoved:
    """Pages gone from `medium` (their descendants in it went before, or in the same event).
    Built with values, or by the recorder from pages (`of_pages`). Compares by value."""

    __slots__ = ("_hashes", "_pages", "medium")

    def __init__(self, block_hashes: list[int], medium: str = MEDIUM_GPU) -> None:
        self._hashes: list[int] | None = block_hashes
        self._pages: list[Pages] = []
        self.medium = medium

    @classmethod
    def of_pages(cls, pages: list[Pages], medium: str) -> BlockRemoved:
        """The removal of `pages`, resolved lazily."""
        self = cls.__new__(cls)
        self._hashes, self._pages, self.medium = None, pages, medium
        return self

    @property
    def block_hashes(self) -> list[int]:
        hashes = self._hashes
        if hashes is None:
            hashes = [digest_to_int64(d) for run, start, end in self._pages
                      for d in run.digests()[start:end]]
            self._hashes = hashes
        return hashes

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, BlockRemoved):
            return NotImplemented
        return (self.block_hashes, self.medium) == (other.block_hashes, other.medium)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"BlockRemoved(block_hashes={self.block_hashes!r}, medium={self.medium!r})"


class AllBlocksCleared:
    """Every page of the worker is gone."""

    __slots__ = ()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, AllBlocksCleared)

    def __hash__(self) -> int:
        return hash(AllBlocksCleared)

    def __repr__(self) -> str:
        return "AllBlocksCleared()"


KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]  # noqa: UP007 - runtime alias


class KVEventRecorder:
    """Pending events of one tree, coalesced as SGLang's recorder does: a store chaining from
    the last store's last page extends it; consecutive removals merge. O(1) per call: pages
    are named by reference, never hashed here. `enabled` False: every call is a no-op and
    `new_run` returns None."""

    def __init__(self, page_size: int, *, enabled: bool = False) -> None:
        self.page_size = page_size
        self.enabled = enabled
        self._pending: list[KVEvent] = []

    def new_run(self, keys: list[bytes | int], prior: PageRef | None) -> PageRun | None:
        """The run of new pages `keys` (a list the caller never mutates) chaining from page
        `prior` (None: under the root); None when disabled."""
        if not self.enabled:
            return None
        return PageRun(keys, None, 0) if prior is None else PageRun(keys, prior[0], prior[1])

    def stored(self, run: PageRun | None, start: int, end: int, medium: str = MEDIUM_GPU) -> None:
        """Pages `[start, end)` of `run` stored in `medium`."""
        if run is None or start >= end or not self.enabled:
            return
        tail = self._pending[-1] if self._pending else None
        if isinstance(tail, BlockStored) and tail.medium == medium and tail._pages:
            last_run, last_start, last_end = tail._pages[-1]
            if run is last_run and start == last_end:  # the same run, continued
                tail._pages[-1] = (run, last_start, end)
                return
            if start == 0 and run.parent is last_run and run.parent_page == last_end - 1:
                tail._pages.append((run, start, end))  # chains from the tail's last page
                return
        self._pending.append(BlockStored.of_pages([(run, start, end)], self.page_size, medium))

    def removed(self, run: PageRun | None, start: int, end: int,
                medium: str = MEDIUM_GPU) -> None:
        """Pages `[start, end)` of `run` left `medium`."""
        if run is None or start >= end or not self.enabled:
            return
        tail = self._pending[-1] if self._pending else None
        if isinstance(tail, BlockRemoved) and tail.medium == medium and tail._pages:
            tail._pages.append((run, start, end))
            return
        self._pending.append(BlockRemoved.of_pages([(run, start, end)], medium))

    def cleared(self) -> None:
        """Everything is gone: earlier pending events no longer matter."""
        if self.enabled:
            self._pending = [AllBlocksCleared()]

    def take(self) -> list[KVEvent]:
        """The pending events, oldest first; the recorder starts a new list."""
        out, self._pending = self._pending, []
        return out
