"""Encoders and decoders of SGLang's five PD messages over their frame types (`frames.py`).

Decoders accept exactly what SGLang 0.5.23 sends and raise `FrameError` for anything else.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

from decode_worker.io.kv.sglang.frames import (
    ABORT,
    ABORT_ACK,
    GUARD,
    KV_STATUS,
    REGISTRATION_FRAMES,
    TRANSFER_INFO_FRAMES,
    Abort,
    AbortAck,
    FrameError,
    KVStatus,
    Registration,
    TransferInfo,
    as_int,
    as_text,
    flat,
    num,
    one_list,
    pack_int_lists,
    pack_u64,
)

Frames = Sequence[bytes]


def encode_registration(r: Registration) -> list[bytes]:
    num_state = len(r.state_ptrs)
    return [
        GUARD, b"None", num(r.ip), num(r.port), r.agent_name.encode(), r.agent_metadata,
        pack_u64(r.kv_ptrs), pack_u64(r.aux_ptrs), pack_int_lists([r.state_ptrs], "Q"),
        num(r.gpu_id), num(r.tp_size), num(r.tp_rank), num(r.kv_item_len),
        pack_int_lists([r.state_item_lens], "I"), pack_int_lists([[]], "I"), b"", b"",
        num(r.num_slots), ",".join(r.kv_mem_kinds).encode(), pack_u64(r.kv_item_lens),
        pack_int_lists([[]], "I"), b"", num(r.dcp_size), num(r.dcp_rank),
        pack_int_lists([r.state_data_lens], "Q") if num_state else b"",
    ]


def decode_registration(frames: Frames) -> Registration:
    f = _expect(frames, REGISTRATION_FRAMES, GUARD, "registration")
    if f[1] != b"None":
        raise FrameError(f"registration: frame 1 is {f[1][:20]!r}, expected b'None'")
    kinds = as_text(f[18], "registration KV memory kinds")
    return Registration(
        ip=as_text(f[2], "registration ip"), port=as_int(f[3], "registration port"),
        agent_name=as_text(f[4], "registration agent name"), agent_metadata=bytes(f[5]),
        kv_ptrs=flat(f[6], "Q", "registration KV pointers"),
        aux_ptrs=flat(f[7], "Q", "registration aux pointers"),
        state_ptrs=one_list(f[8], "Q", "registration state pointers"),
        gpu_id=as_int(f[9], "registration gpu id"), tp_size=as_int(f[10], "registration tp size"),
        tp_rank=as_int(f[11], "registration tp rank"),
        kv_item_len=as_int(f[12], "registration KV item length"),
        state_item_lens=one_list(f[13], "I", "registration state item lengths"),
        num_slots=as_int(f[17], "registration slots"),
        kv_mem_kinds=tuple(kinds.split(",")) if kinds else (),
        kv_item_lens=flat(f[19], "Q", "registration KV item lengths"),
        state_data_lens=one_list(f[24], "Q", "registration state data lengths"),
        dcp_size=as_int(f[22], "registration dcp size"),
        dcp_rank=as_int(f[23], "registration dcp rank"),
    )  # fmt: skip


def encode_transfer_info(t: TransferInfo) -> list[bytes]:
    return [
        GUARD, num(t.room), num(t.ip), num(t.port), t.agent_name.encode(),
        struct_i32(t.kv_page_ids), num(t.aux_row), num(t.required_dst_info_num),
        pack_int_lists([t.state_page_ids], "i"), num(t.decode_prefix_len),
        b"1" if t.is_dummy else b"0",
    ]


def decode_transfer_info(frames: Frames) -> TransferInfo:
    f = _expect(frames, TRANSFER_INFO_FRAMES, GUARD, "transfer info")
    if f[10] not in (b"0", b"1"):
        raise FrameError(f"transfer info: is_dummy is {f[10][:20]!r}, expected b'0' or b'1'")
    return TransferInfo(
        room=as_int(f[1], "transfer info room"), ip=as_text(f[2], "transfer info ip"),
        port=as_int(f[3], "transfer info port"), agent_name=as_text(f[4], "transfer info agent"),
        kv_page_ids=flat(f[5], "i", "transfer info KV page ids"),
        aux_row=as_int(f[6], "transfer info aux row"),
        required_dst_info_num=as_int(f[7], "transfer info required_dst_info_num"),
        state_page_ids=one_list(f[8], "i", "transfer info state page ids"),
        decode_prefix_len=as_int(f[9], "transfer info decode_prefix_len"), is_dummy=f[10] == b"1",
    )  # fmt: skip


def encode_abort(a: Abort) -> list[bytes]:
    out = [ABORT, num(a.room)]
    if a.ip is not None and a.port is not None and a.generation is not None:
        out += [num(a.ip), num(a.port), num(a.generation)]
    return out


def decode_abort(frames: Frames) -> Abort:
    f = list(frames)
    if len(f) not in (2, 5) or f[0] != ABORT:
        raise FrameError(f"abort: {len(f)} frames starting {f[0][:20] if f else b''!r}")
    room = as_int(f[1], "abort room")
    if len(f) == 2:
        return Abort(room)
    return Abort(room, as_text(f[2], "abort ip"), as_int(f[3], "abort port"),
                 as_int(f[4], "abort generation"))


def encode_kv_status(s: KVStatus) -> list[bytes]:
    return [KV_STATUS, num(s.room), num(s.status), num(s.prefill_rank),
            s.reason.encode()]


def decode_kv_status(frames: Frames) -> KVStatus:
    f = _expect(frames, 5, KV_STATUS, "KV_STATUS")
    return KVStatus(as_int(f[1], "KV_STATUS room"), as_int(f[2], "KV_STATUS status"),
                    as_int(f[3], "KV_STATUS prefill rank"), as_text(f[4], "KV_STATUS reason"))


def encode_abort_ack(a: AbortAck) -> list[bytes]:
    return [ABORT_ACK, num(a.room), num(a.prefill_rank), num(a.generation)]


def decode_abort_ack(frames: Frames) -> AbortAck:
    f = _expect(frames, 4, ABORT_ACK, "ABORT_ACK")
    return AbortAck(as_int(f[1], "ABORT_ACK room"), as_int(f[2], "ABORT_ACK prefill rank"),
                    as_int(f[3], "ABORT_ACK generation"))


def decode_from_prefill(frames: Frames) -> KVStatus | AbortAck:
    """What a decode side's PULL socket receives: KV_STATUS or ABORT_ACK."""
    tag = frames[0] if frames else b""
    if tag == KV_STATUS:
        return decode_kv_status(frames)
    if tag == ABORT_ACK:
        return decode_abort_ack(frames)
    raise FrameError(f"unknown message from a prefill: tag {bytes(tag[:20])!r}")


def decode_from_decode(frames: Frames) -> Registration | TransferInfo | Abort:
    """What a prefill rank's PULL socket receives: a registration, a transfer info or ABORT."""
    tag = frames[0] if frames else b""
    if tag == ABORT:
        return decode_abort(frames)
    if tag == GUARD and len(frames) > 1 and frames[1] == b"None":
        return decode_registration(frames)
    if tag == GUARD:
        return decode_transfer_info(frames)
    raise FrameError(f"unknown message from a decode side: tag {bytes(tag[:20])!r}")


def struct_i32(values: Sequence[int]) -> bytes:
    """`np.int32(values).tobytes()` (little-endian)."""
    return struct.pack(f"<{len(values)}i", *values)


def _expect(frames: Frames, count: int, tag: bytes, what: str) -> list[bytes]:
    f = [bytes(x) for x in frames]
    if len(f) != count:
        raise FrameError(f"{what}: {len(f)} frames, expected {count}")
    if f[0] != tag:
        raise FrameError(f"{what}: frame 0 is {f[0][:20]!r}, expected {tag!r}")
    return f
