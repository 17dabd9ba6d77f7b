"""SGLang 0.5.23's PD transfer messages (NIXL backend) as raw ZMQ multipart frames (pure).

Every message is a list of byte frames: decimal integers as ASCII, pointer and length arrays as
packed little-endian integers, no msgpack, no pickle (docs/CONTRACTS.md, "SGLang protocol").

```
decode -> prefill   GUARD, b"None", ip, port, agent, metadata, ...        Registration (25 frames)
decode -> prefill   GUARD, room, ip, port, agent, kv ids, aux row, ...    TransferInfo (11 frames)
decode -> prefill   b"ABORT", room[, ip, port, generation]                Abort
prefill -> decode   b"KV_STATUS", room, status, prefill rank, reason      KVStatus
prefill -> decode   b"ABORT_ACK", room, prefill rank, generation          AbortAck
```
Each `encode_*` gives the frames SGLang's own code sends, byte for byte (checked against
captured frames); each `decode_*` raises `FrameError` (a `TransferError`) naming the frame that
is wrong, never anything else, for any input.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

from decode_worker.errors import TransferError

GUARD = b"NixlMsgGuard"
KV_STATUS, ABORT, ABORT_ACK = b"KV_STATUS", b"ABORT", b"ABORT_ACK"
REGISTRATION_FRAMES = 25  # GUARD + 24
TRANSFER_INFO_FRAMES = 11  # GUARD + 10


class FrameError(TransferError):
    """A message that is not a valid SGLang frame list; says which frame and why."""


class Status:
    """KV_STATUS values (sglang `KVPoll`)."""

    FAILED = 0
    BOOTSTRAPPING = 1
    WAITING_FOR_INPUT = 2
    TRANSFERRING = 3
    SUCCESS = 4


@dataclass(frozen=True, slots=True)
class Registration:
    """The decode side's first contact with one prefill rank (SGLang `KVArgsRegisterInfo`).

    `kv_ptrs`: base addresses of the full-attention entries, K of every full layer then V;
    `kv_item_lens`: each entry's page stride in bytes; `state_ptrs` / `state_item_lens`: the SWA
    entries likewise (one component); `aux_ptrs`: the aux buffers' bases, positional;
    `num_slots`: pages addressable per KV entry; `state_data_lens`: bytes per SWA entry."""

    ip: str
    port: int
    agent_name: str
    agent_metadata: bytes
    kv_ptrs: tuple[int, ...]
    aux_ptrs: tuple[int, ...]
    state_ptrs: tuple[int, ...]
    gpu_id: int
    tp_size: int
    tp_rank: int
    kv_item_len: int
    state_item_lens: tuple[int, ...]
    num_slots: int
    kv_mem_kinds: tuple[str, ...]
    kv_item_lens: tuple[int, ...]
    state_data_lens: tuple[int, ...]
    dcp_size: int = 1
    dcp_rank: int = 0


@dataclass(frozen=True, slots=True)
class TransferInfo:
    """One request's destination (SGLang `TransferInfo`): the decode KV page ids of
    `[decode_prefix_len, L)` in prefill pages, the aux row, and the SWA pages of the window."""

    room: int
    ip: str
    port: int
    agent_name: str
    kv_page_ids: tuple[int, ...]
    aux_row: int
    required_dst_info_num: int
    state_page_ids: tuple[int, ...]
    decode_prefix_len: int
    is_dummy: bool = False


@dataclass(frozen=True, slots=True)
class Abort:
    room: int
    ip: str | None = None
    port: int | None = None
    generation: int | None = None


@dataclass(frozen=True, slots=True)
class KVStatus:
    room: int
    status: int
    prefill_rank: int
    reason: str = ""


@dataclass(frozen=True, slots=True)
class AbortAck:
    room: int
    prefill_rank: int
    generation: int


# -- packing helpers (sglang disaggregation/common/utils.py) ----------------------------------
def pack_u64(values: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(values)}Q", *values)


def pack_int_lists(lists: Sequence[Sequence[int]], fmt: str) -> bytes:
    """`[u32 n][u32 byte length of each list]*n` then each list packed with `fmt`; b"" for no
    lists."""
    if not lists:
        return b""
    bodies = [struct.pack(f"<{len(x)}{fmt}", *x) for x in lists]
    head = struct.pack(f"<{len(bodies) + 1}I", len(bodies), *(len(b) for b in bodies))
    return head + b"".join(bodies)


def unpack_int_lists(data: bytes, fmt: str, what: str) -> list[list[int]]:
    if not data:
        return []
    size = struct.calcsize(f"<{fmt}")
    try:
        (n,) = struct.unpack_from("<I", data)
        lens = struct.unpack_from(f"<{n}I", data, 4)
        out, offset = [], 4 + 4 * n
        for length in lens:
            if length % size or offset + length > len(data):
                raise FrameError(f"{what}: a list of {length} bytes does not fit")
            out.append(list(struct.unpack_from(f"<{length // size}{fmt}", data, offset)))
            offset += length
    except struct.error as exc:
        raise FrameError(f"{what}: truncated int lists ({exc})") from None
    if offset != len(data):
        raise FrameError(f"{what}: {len(data) - offset} stray bytes after the int lists")
    return out


def flat(data: bytes, fmt: str, what: str) -> tuple[int, ...]:
    size = struct.calcsize(f"<{fmt}")
    if len(data) % size:
        raise FrameError(f"{what}: {len(data)} bytes is not a whole number of {size}-byte ints")
    return struct.unpack(f"<{len(data) // size}{fmt}", data)


def as_int(frame: bytes, what: str) -> int:
    try:
        text = frame.decode("ascii")
        if not text.lstrip("-").isdigit():
            raise ValueError(text)
        return int(text)
    except (UnicodeDecodeError, ValueError):
        raise FrameError(f"{what}: expected a decimal integer, got {frame[:40]!r}") from None


def as_text(frame: bytes, what: str) -> str:
    try:
        return frame.decode("utf-8")
    except UnicodeDecodeError:
        raise FrameError(f"{what}: not UTF-8 ({frame[:40]!r})") from None


def num(value: int | str) -> bytes:
    return str(value).encode("ascii")


def one_list(data: bytes, fmt: str, what: str) -> tuple[int, ...]:
    lists = unpack_int_lists(data, fmt, what)
    if len(lists) > 1:
        raise FrameError(f"{what}: {len(lists)} components, expected at most one (SWA)")
    return tuple(lists[0]) if lists else ()
