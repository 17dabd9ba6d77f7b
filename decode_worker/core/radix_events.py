"""KV events of the radix tree's full-attention pages, as SGLang's tree records them (pure).

The tree reports what its full-attention pages do, page by page, so that a consumer applying the
events in order holds exactly the pages the worker could reuse:

- `BlockStored`: pages entered the tree (a new leaf, or a host-tier page promoted back);
- `BlockRemoved`: pages left a medium (device eviction, including a leaf trimmed page by page,
  or a demotion to the host tier, which is a removal from `GPU` plus a store in `CPU_PINNED`);
- `AllBlocksCleared`: the tree is empty (cache flush).

SWA-only changes (tombstones) are silent: a tombstone keeps the full KV, which TRANSFER matches
still reuse. Node splits are silent too: both halves keep their page hashes.

Page identity is SGLang's page chain (its `mem_cache/utils.py::get_hash_str` and
`hash_str_to_int64`): a page's digest is SHA-256 over the previous page's 32-byte digest (none
for the first page under the root) followed by the page's token ids as little-endian u32; the
published hash is the digest's first 8 bytes read big-endian as a signed int64.

The records are plain data; the shell encodes them (msgpack, gRPC). Not thread-safe: the
compute thread records and takes; what `take` returns is never touched again by the recorder.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Union

MEDIUM_GPU = "GPU"
MEDIUM_CPU_PINNED = "CPU_PINNED"
_NATIVE_LE = sys.byteorder == "little"


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Pages stored, in chain order: `block_hashes[i]` names `token_ids[i*block_size:
    (i+1)*block_size]`; the first page chains from `parent_block_hash` (None: under the root)."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    medium: str = MEDIUM_GPU
    lora_id: int | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Pages gone from `medium` (their descendants in it went before, or in the same event)."""

    block_hashes: list[int]
    medium: str = MEDIUM_GPU


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """Every page of the worker is gone."""


KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]  # noqa: UP007 - runtime alias


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
        return struct.pack("<I", key)
    if _NATIVE_LE:
        return key
    n = len(key) // 4
    return struct.pack(f"<{n}i", *struct.unpack(f"={n}i", key))


class KVEventRecorder:
    """Pending events of one tree, coalesced as SGLang's recorder does: a store chaining from
    the last store's last page extends it; consecutive removals merge. `enabled` False: every
    call is a no-op and digests are not computed (`digests` returns [])."""

    def __init__(self, page_size: int, *, enabled: bool = False) -> None:
        self.page_size = page_size
        self.enabled = enabled
        self._pending: list[KVEvent] = []

    def digests(self, prior: bytes | None, keys: Sequence[bytes | int]) -> list[bytes]:
        """Chained digests of pages `keys` after `prior` ([] when disabled)."""
        if not self.enabled:
            return []
        out: list[bytes] = []
        sha = hashlib.sha256
        if _NATIVE_LE and self.page_size > 1:  # the keys are the hash input already
            for key in keys:
                page = key if isinstance(key, bytes) else key.to_bytes(4, "little")
                prior = sha(prior + page if prior is not None else page).digest()
                out.append(prior)
            return out
        for key in keys:
            prior = page_digest(prior, key_le_u32(key))
            out.append(prior)
        return out

    def stored(
        self,
        parent: bytes | None,
        digests: Sequence[bytes],
        keys: Sequence[bytes | int],
        medium: str = MEDIUM_GPU,
    ) -> None:
        """Pages `keys` (with `digests`) stored below the page whose digest is `parent`."""
        if not self.enabled or not digests:
            return
        hashes = [digest_to_int64(d) for d in digests]
        tokens = key_tokens(keys, self.page_size)
        parent_hash = digest_to_int64(parent) if parent is not None else None
        tail = self._pending[-1] if self._pending else None
        if (isinstance(tail, BlockStored) and tail.medium == medium and parent_hash is not None
                and tail.block_hashes[-1] == parent_hash):
            tail.block_hashes.extend(hashes)
            tail.token_ids.extend(tokens)
            return
        self._pending.append(
            BlockStored(hashes, parent_hash, tokens, self.page_size, medium))

    def removed(self, digests: Sequence[bytes], medium: str = MEDIUM_GPU) -> None:
        """Pages with `digests` left `medium`."""
        if not self.enabled or not digests:
            return
        hashes = [digest_to_int64(d) for d in digests]
        tail = self._pending[-1] if self._pending else None
        if isinstance(tail, BlockRemoved) and tail.medium == medium:
            tail.block_hashes.extend(hashes)
            return
        self._pending.append(BlockRemoved(hashes, medium))

    def cleared(self) -> None:
        """Everything is gone: earlier pending events no longer matter."""
        if self.enabled:
            self._pending = [AllBlocksCleared()]

    def take(self) -> list[KVEvent]:
        """The pending events, oldest first; the recorder starts a new list."""
        out, self._pending = self._pending, []
        return out
