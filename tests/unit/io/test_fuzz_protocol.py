"""Fuzzing the native KV-transfer protocol's decoders (`io/kv/protocol.py`) and a request's
validation (`protocol_check.validate_request`): random bytes, byte-level mutations of valid
frames and field-level mutations of valid messages give a message or the decoder's typed error
(ProtocolError / PageError), never anything else. SGLang's frame decoders are fuzzed in
`test_sglang_frames.py`."""

from __future__ import annotations

import contextlib
from typing import Any

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from decode_worker.errors import IncompatiblePeer, PageError, ProtocolError
from decode_worker.io.kv import protocol as p
from decode_worker.io.kv.protocol_check import check_compat, validate_request
from tests.examples import examples

COMPAT = p.ModelCompat("m", "bfloat16", ["swa", "full"], 8, 64, 16, 127)
REGIONS = {name: p.RegionLayout(name, 4096, 2, rows, 1024, 0, "DRAM")  # type: ignore[arg-type]
           for name, rows in (("full", 33), ("swa", 17), ("aux", 8))}
VALID: list[p.Message] = [
    p.Hello(p.PROTOCOL_VERSION, COMPAT, "decode-1", b"\x00meta", list(REGIONS.values())),
    p.Welcome(p.PROTOCOL_VERSION, COMPAT, "prefill-1", 1.0),
    p.Refused("incompatible"), p.Ping(3), p.Pong(3),
    p.TransferRequest(7, 2**62, "rid-1", 40, 16, 32, [1, 2], [3], 0, 30.0, list(range(40))),
    p.Abort(7, 9), p.AbortAck(7, 9), p.TransferDone(7, 9, 4096, 4),
    p.TransferFailed(7, 9, "kv_timeout"),
]
NOTIF = p.Notif(7, 9, 0, 2, 12)

# msgpack-representable values a peer could put in a field
json_like = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=True)
    | st.text(max_size=20) | st.binary(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                               max_size=4),
    max_leaves=12)


def decode_or_protocol_error(raw: bytes) -> p.Message | None:
    """The decoded message, or None when it raised ProtocolError (anything else propagates)."""
    try:
        return p.decode(raw)
    except ProtocolError as exc:
        assert str(exc), "a ProtocolError must say what was wrong"
        return None


@settings(max_examples=examples(400), deadline=None)
@given(raw=st.binary(max_size=200))
def test_random_bytes_give_a_message_or_a_protocol_error(raw: bytes) -> None:
    decode_or_protocol_error(raw)
    with contextlib.suppress(ProtocolError):
        p.decode_notif(raw)
    with contextlib.suppress(ProtocolError):
        p.decode_notif(p.NOTIF_PREFIX + raw)


@settings(max_examples=examples(400), deadline=None)
@given(data=st.data())
def test_byte_mutations_of_valid_frames_never_crash_the_decoder(data: st.DataObject) -> None:
    msg = data.draw(st.sampled_from(VALID))
    raw = bytearray(p.encode(msg))
    op = data.draw(st.sampled_from(["flip", "truncate", "insert", "splice"]))
    i = data.draw(st.integers(0, len(raw) - 1))
    if op == "flip":
        raw[i] ^= data.draw(st.integers(1, 255))
    elif op == "truncate":
        del raw[i:]
    elif op == "insert":
        raw[i:i] = data.draw(st.binary(min_size=1, max_size=8))
    else:
        other = p.encode(data.draw(st.sampled_from(VALID)))
        raw[i:] = other[data.draw(st.integers(0, len(other) - 1)):]
    decode_or_protocol_error(bytes(raw))
    notif = bytearray(p.encode_notif(NOTIF))
    j = data.draw(st.integers(0, len(notif) - 1))
    notif[j] ^= data.draw(st.integers(1, 255))
    with contextlib.suppress(ProtocolError):
        p.decode_notif(bytes(notif))


def _mutate_fields(obj: dict[str, Any], data: st.DataObject) -> None:
    op = data.draw(st.sampled_from(["replace", "drop", "add", "retag"]))
    if not obj:
        op = "add"
    if op in ("replace", "drop"):
        key = data.draw(st.sampled_from(sorted(obj)))
        if op == "replace":
            obj[key] = data.draw(json_like)
        else:
            del obj[key]
    elif op == "add":
        obj[data.draw(st.text(min_size=1, max_size=8))] = data.draw(json_like)
    else:
        obj["t"] = data.draw(st.sampled_from(["Hello", "Ping", "Nope", "", "TransferRequest"]))


@settings(max_examples=examples(400), deadline=None)
@given(data=st.data())
def test_field_mutations_give_a_message_or_a_protocol_error(data: st.DataObject) -> None:
    """A well-formed msgpack map with a wrong, missing, extra or retagged field."""
    obj = msgspec.msgpack.decode(p.encode(data.draw(st.sampled_from(VALID))))
    assert isinstance(obj, dict)
    for _ in range(data.draw(st.integers(1, 3))):
        _mutate_fields(obj, data)
    msg = decode_or_protocol_error(msgspec.msgpack.encode(obj))
    if isinstance(msg, p.Hello | p.Welcome):
        with contextlib.suppress(IncompatiblePeer):
            check_compat(COMPAT, msg.compat, msg.version)
    if isinstance(msg, p.TransferRequest):
        with contextlib.suppress(PageError):
            validate_request(msg, 16, REGIONS)


@settings(max_examples=examples(300), deadline=None)
@given(prompt_len=st.integers(-5, 600), reused=st.integers(-20, 600),
       swa=st.integers(-20, 600), full=st.lists(st.integers(-2, 40), max_size=40),
       swa_ids=st.lists(st.integers(-2, 20), max_size=40), aux=st.integers(-3, 10))
def test_transfer_requests_with_any_numbers_pass_or_raise_page_error(
        prompt_len: int, reused: int, swa: int, full: list[int], swa_ids: list[int],
        aux: int) -> None:
    req = p.TransferRequest(1, 1, "r", prompt_len, reused, swa, full, swa_ids, aux, 1.0)
    try:
        validate_request(req, 16, REGIONS)
    except PageError as exc:
        assert f"room {req.room}" in str(exc)
        return
    n_pages = -(-prompt_len // 16)
    assert len(full) == n_pages - reused // 16 and len(set(full)) == len(full)
    assert all(1 <= x < 33 for x in full) and 0 <= aux < 8
