"""SGLang's PD frames: every encoder gives the bytes SGLang 0.5.23's own code sent (captured by
tests/interop/sglang_prefill/capture_frames.py into tests/data/sglang_frames), every decoder
reads them back, and malformed frames raise FrameError naming the problem, never anything else."""

from __future__ import annotations

import base64
import contextlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from decode_worker.io.kv.sglang import messages as m
from decode_worker.io.kv.sglang.frames import (
    FrameError,
    Registration,
    TransferInfo,
    pack_int_lists,
    unpack_int_lists,
)
from tests.examples import examples

DATA = Path(__file__).resolve().parents[2] / "data" / "sglang_frames"
CODECS: dict[str, tuple[Callable[[Any], list[bytes]], Callable[[Any], Any]]] = {
    "register": (m.encode_registration, m.decode_registration),
    "transfer_info": (m.encode_transfer_info, m.decode_transfer_info),
    "transfer_info_decode_prefix": (m.encode_transfer_info, m.decode_transfer_info),
    "kv_status_success": (m.encode_kv_status, m.decode_kv_status),
    "kv_status_failed": (m.encode_kv_status, m.decode_kv_status),
    "kv_status_failed_state_mismatch": (m.encode_kv_status, m.decode_kv_status),
    "abort": (m.encode_abort, m.decode_abort),
    "abort_ack": (m.encode_abort_ack, m.decode_abort_ack),
}


def golden(name: str) -> tuple[list[bytes], dict[str, Any]]:
    doc = json.loads((DATA / f"{name}.frames.json").read_text())
    return [base64.b64decode(f) for f in doc["frames"]], doc


@pytest.mark.parametrize("name", sorted(CODECS))
def test_golden_frames_round_trip_byte_exact(name: str) -> None:
    frames, _ = golden(name)
    encode, decode = CODECS[name]
    assert encode(decode(frames)) == frames


def test_registration_fields_match_what_sglang_decoded() -> None:
    frames, doc = golden("register")
    reg = m.decode_registration(frames)
    want = doc["sglang_decoded"]
    assert isinstance(reg, Registration)
    assert reg.port == want["dst_port"] and reg.agent_name == want["agent_name"]
    assert list(reg.kv_ptrs) == want["dst_kv_ptrs"]
    assert list(reg.aux_ptrs) == want["dst_aux_ptrs"]
    assert [list(reg.state_ptrs)] == want["dst_state_data_ptrs"]
    assert [list(reg.state_item_lens)] == want["dst_state_item_lens"]
    assert [list(reg.state_data_lens)] == want["dst_state_data_lens"]
    assert reg.num_slots == want["dst_num_slots"] and list(reg.kv_item_lens) == want[
        "dst_kv_item_lens"]
    assert list(reg.kv_mem_kinds) == want["dst_kv_mem_kinds"]


@pytest.mark.parametrize("name", ["transfer_info", "transfer_info_decode_prefix"])
def test_transfer_info_fields_match_what_sglang_decoded(name: str) -> None:
    frames, doc = golden(name)
    info = m.decode_transfer_info(frames)
    want = doc["sglang_decoded"]
    assert isinstance(info, TransferInfo)
    assert info.room == want["room"] and list(info.kv_page_ids) == want["dst_kv_indices"]
    assert [list(info.state_page_ids)] == want["dst_state_indices"]
    assert info.aux_row == want["dst_aux_index"]
    assert info.decode_prefix_len == want["decode_prefix_len"]


def test_status_and_ack_decode_from_the_pull_socket() -> None:
    ok = m.decode_from_prefill(golden("kv_status_success")[0])
    failed = m.decode_from_prefill(golden("kv_status_failed")[0])
    ack = m.decode_from_prefill(golden("abort_ack")[0])
    assert isinstance(ok, m.KVStatus) and ok.status == 4 and ok.room == 2001
    assert isinstance(failed, m.KVStatus) and failed.reason == "synthetic prefill failure"
    assert isinstance(ack, m.AbortAck) and ack.room == 2005 and ack.generation == 1


def test_the_prefill_side_tells_its_three_messages_apart() -> None:
    assert isinstance(m.decode_from_decode(golden("register")[0]), Registration)
    assert isinstance(m.decode_from_decode(golden("transfer_info")[0]), TransferInfo)
    assert isinstance(m.decode_from_decode(golden("abort")[0]), m.Abort)


@pytest.mark.parametrize(("frames", "words"), [
    ([b"KV_STATUS", b"12", b"x", b"0", b""], "status"),
    ([b"KV_STATUS", b"12", b"4", b"0"], "4 frames"),
    ([b"ABORT_ACK", b"1", b"0", b"\xff"], "generation"),
    ([b"PING"], "unknown message"),
    ([], "unknown message"),
])
def test_malformed_status_frames_name_the_problem(frames: list[bytes], words: str) -> None:
    with pytest.raises(FrameError, match=words):
        m.decode_from_prefill(frames)


def test_truncated_int_lists_are_refused() -> None:
    good = pack_int_lists([[1, 2, 3]], "i")
    assert unpack_int_lists(good, "i", "x") == [[1, 2, 3]]
    for bad in (good[:-1], good + b"\0", good[:6], b"\xff\xff\xff\x7f"):
        with pytest.raises(FrameError):
            unpack_int_lists(bad, "i", "x")


frames_strategy = st.lists(st.binary(max_size=40), max_size=30)


@settings(max_examples=examples(300), deadline=None)
@given(frames=frames_strategy)
def test_random_frames_give_a_frame_error_or_a_message(frames: list[bytes]) -> None:
    for decode in (m.decode_from_prefill, m.decode_from_decode):
        with contextlib.suppress(FrameError):
            decode(frames)


@settings(max_examples=examples(300), deadline=None)
@given(data=st.data())
def test_mutated_golden_frames_never_crash_a_decoder(data: st.DataObject) -> None:
    name = data.draw(st.sampled_from(sorted(CODECS)))
    frames, _ = golden(name)
    i = data.draw(st.integers(0, len(frames) - 1))
    mutated = list(frames)
    op = data.draw(st.sampled_from(["replace", "drop", "truncate"]))
    if op == "replace":
        mutated[i] = data.draw(st.binary(max_size=64))
    elif op == "drop":
        del mutated[i]
    else:
        mutated[i] = mutated[i][: data.draw(st.integers(0, max(len(mutated[i]) - 1, 0)))]
    for decode in (m.decode_from_prefill, m.decode_from_decode):
        with contextlib.suppress(FrameError):
            decode(mutated)
