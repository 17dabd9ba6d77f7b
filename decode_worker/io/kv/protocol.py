"""The KV-transfer wire protocol: versioned, tagged msgspec structs over msgpack (no pickle).

Control plane (ZMQ DEALER on the decode side -> ROUTER on the prefill peer):

    decode                                   prefill
      Hello(version, compat, agent, regions) ->
                                          <- Welcome(version, compat, agent) | Refused(reason)
      Ping(seq)                           ->
                                          <- Pong(seq)
      TransferRequest(transfer_id, room, ...) ->
                                          <- TransferDone | TransferFailed   (after the WRITEs)
      Abort(transfer_id, room, reason)    ->
                                          <- AbortAck(transfer_id, room)     (no more writes)

`Abort` also carries the decode side's end of a request (`reason`, `detail`): the prefill peer
answers its own HTTP client with that reason. `transfer_id` 0 names no transfer (the decode side
refused the request before asking for one); such an Abort needs no handshake.
With `TransferRequest.kv_checksum`, `TransferDone.kv_checksum` is the CRC-32 of the pages written
(`kv_checksum.py`); the decode side checks it before the request starts.

Data plane: NIXL WRITEs from the prefill pools into the decode regions; each WRITE carries a
`Notif` (encoded with `encode_notif`) naming the transfer and its part; the decode side
completes a transfer when it holds all `num_parts` notifications of it.

Regions: `RegionLayout` describes one registered tensor as rows of `row_bytes`:
`addr(layer, row) = addr + (layer * rows_per_layer + row) * row_bytes`. A KV pool is
`[num_layers, num_pages + 1, 2, page_size, kv_heads, head_dim]`, so a row is one page (K and V)
and `rows_per_layer = num_pages + 1` (page 0 is the reserved dummy page). The aux buffer is one
layer of `num_rows` rows.

The handshake's compatibility check and a request's validation live in `protocol_check`.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from decode_worker.errors import ProtocolError

PROTOCOL_VERSION = 3
NOTIF_PREFIX = b"dw1:"


class _Msg(msgspec.Struct, frozen=True, tag_field="t", forbid_unknown_fields=True):
    """Base of every control message; the class name is the tag on the wire."""


class ModelCompat(msgspec.Struct, frozen=True):
    """What both sides must agree on before any KV moves.

    `window` is the number of earlier tokens a sliding-window query sees (HF `sliding_window - 1`).
    `layer_kinds` lists "full" or "swa" per model layer, in model order.
    """

    model: str
    dtype: str
    layer_kinds: list[str]
    num_kv_heads: int
    head_dim: int
    page_size: int
    window: int


class RegionLayout(msgspec.Struct, frozen=True):
    """One registered memory region seen as `num_layers x rows_per_layer` rows of `row_bytes`
    ("landing": every model layer, where an SGLang prefill of an all-layer model writes)."""

    name: Literal["full", "swa", "aux", "landing"]
    addr: int
    num_layers: int
    rows_per_layer: int
    row_bytes: int
    device_id: int
    kind: Literal["DRAM", "VRAM"]

    @property
    def length(self) -> int:
        return self.num_layers * self.rows_per_layer * self.row_bytes

    def row_addr(self, layer: int, row: int) -> int:
        return self.addr + (layer * self.rows_per_layer + row) * self.row_bytes


class Hello(_Msg, frozen=True):
    version: int
    compat: ModelCompat
    agent_name: str
    agent_metadata: bytes
    regions: list[RegionLayout]


class Welcome(_Msg, frozen=True):
    version: int
    compat: ModelCompat
    agent_name: str
    heartbeat_interval_s: float


class Refused(_Msg, frozen=True):
    reason: str


class Ping(_Msg, frozen=True):
    seq: int


class Pong(_Msg, frozen=True):
    seq: int


class TransferRequest(_Msg, frozen=True):
    """Decode asks for the KV it lacks. Token ranges (L = prompt_len, P = reused_len, S =
    swa_window_start, all page-aligned except L):

        [0 ........ P ........ S ........ L)
         cached here |<- full_page_ids ------>|   one id per page of [P, L)
                                |<- swa --->|   one id per page of [S, L)

    The prefill side uses S as given (it never recomputes the window). `aux_row` is the aux row
    that receives the first output token (named `aux_slot` on the wire). `deadline_s` is
    relative: how long decode will wait. `prompt_ids`, when set, is the prompt itself
    (router-less use); otherwise the prefill peer takes it from its own HTTP request with the
    same room.
    """

    transfer_id: int
    room: int
    rid: str
    prompt_len: int
    reused_len: int
    swa_window_start: int
    full_page_ids: list[int]
    swa_page_ids: list[int]
    aux_row: int = msgspec.field(name="aux_slot")  # the wire keeps its name: same protocol
    deadline_s: float
    prompt_ids: list[int] | None = None  # set when no router sends the prompt to prefill's HTTP
    kv_checksum: bool = False  # ask for TransferDone.kv_checksum


class Abort(_Msg, frozen=True):
    """The decode side ended the request of `room` (`reason`: its abort label, `detail`: its
    message); `transfer_id` 0: no transfer was asked for (only the HTTP side is answered)."""

    transfer_id: int
    room: int
    reason: str = ""
    detail: str = ""


class AbortAck(_Msg, frozen=True):
    """The prefill peer will not write into the pages of this transfer any more."""

    transfer_id: int
    room: int


class TransferDone(_Msg, frozen=True):
    transfer_id: int
    room: int
    num_bytes: int
    num_descriptors: int
    kv_checksum: int | None = None  # CRC-32 of the written pages, when the request asked


class TransferFailed(_Msg, frozen=True):
    transfer_id: int
    room: int
    reason: str


Message = (
    Hello
    | Welcome
    | Refused
    | Ping
    | Pong
    | TransferRequest
    | Abort
    | AbortAck
    | TransferDone
    | TransferFailed
)


class Notif(msgspec.Struct, frozen=True, array_like=True):
    """The NIXL notification of one WRITE: part `part` of `num_parts` of a transfer."""

    transfer_id: int
    room: int
    part: int
    num_parts: int
    num_descriptors: int


class _VersionPeek(msgspec.Struct):
    t: str = ""
    version: int = -1


_encoder = msgspec.msgpack.Encoder()
_decoder: msgspec.msgpack.Decoder[Message] = msgspec.msgpack.Decoder(Message)
_notif_decoder = msgspec.msgpack.Decoder(Notif)
_peek_decoder = msgspec.msgpack.Decoder(_VersionPeek)


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def decode(raw: bytes) -> Message:
    """Decode one control frame. Raises ProtocolError naming the version when it differs."""
    try:
        return _decoder.decode(raw)
    except msgspec.ValidationError as exc:
        try:
            peek = _peek_decoder.decode(raw)
        except msgspec.DecodeError:
            peek = _VersionPeek()
        if peek.version not in (-1, PROTOCOL_VERSION):
            raise ProtocolError(
                f"peer speaks protocol version {peek.version}, we speak {PROTOCOL_VERSION}"
            ) from None
        raise ProtocolError(f"malformed {peek.t or 'control'} message: {exc}") from None
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"undecodable control frame: {exc}") from None


def encode_notif(notif: Notif) -> bytes:
    return NOTIF_PREFIX + _encoder.encode(notif)


def decode_notif(raw: bytes) -> Notif:
    """Raises ProtocolError for anything that is not one of our notifications."""
    if not raw.startswith(NOTIF_PREFIX):
        raise ProtocolError(f"foreign notification {raw[:32]!r}")
    try:
        return _notif_decoder.decode(raw[len(NOTIF_PREFIX) :])
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"malformed notification: {exc}") from None
