"""SGLang's `PrefillServerInfo` (the bootstrap server's `GET /route?...=-1` answer) and the
checks a decode side does against it before any KV moves (pure).

SGLang's prefill checks nothing about its decode peer; SGLang's own decode checks page size,
KV dtype string and layout. Here every refusal is an `IncompatiblePeer` (a TransferError) whose
message names both values and the prefill flag (or worker setting) to change.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from decode_worker.errors import IncompatiblePeer, ProtocolError
from decode_worker.io.kv.protocol import ModelCompat

# SGLang --kv-cache-dtype spellings -> torch dtype names (ModelCompat.dtype)
_KV_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32",
              "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}


@dataclass(frozen=True, slots=True)
class PrefillServerInfo:
    """The fields of SGLang 0.5.23's `PrefillServerInfo` this side reads."""

    attn_tp_size: int
    attn_cp_size: int
    dp_size: int
    pp_size: int
    page_size: int | None
    kv_cache_dtype: str | None
    follow_bootstrap_room: bool
    kv_layout: str | None = None
    decode_allocation_policy: str = "early"
    enable_dsa_cache_layer_split: bool = False
    enable_kv_cache_sharding: bool = False
    has_dsv41_spec_layout: bool = False
    prefill_http_port: int | None = None


@dataclass(frozen=True, slots=True)
class RankEndpoint:
    """One prefill rank's ZMQ PULL socket (`GET /route` with that rank's query)."""

    dp_rank: int
    tp_rank: int
    ip: str
    port: int


def parse_server_info(body: Any) -> PrefillServerInfo:
    """The JSON body of a 200 answer. Raises ProtocolError naming the bad field."""
    if not isinstance(body, dict):
        raise ProtocolError(f"SGLang server info: expected a JSON object, got {body!r:.80}")
    return PrefillServerInfo(
        attn_tp_size=_int(body, "attn_tp_size"), attn_cp_size=_int(body, "attn_cp_size", 1),
        dp_size=_int(body, "dp_size", 1), pp_size=_int(body, "pp_size", 1),
        page_size=_opt(body, "page_size", int), kv_cache_dtype=_opt(body, "kv_cache_dtype", str),
        follow_bootstrap_room=bool(body.get("follow_bootstrap_room", False)),
        kv_layout=_opt(body, "kv_layout", str),
        decode_allocation_policy=str(body.get("decode_allocation_policy") or "early"),
        enable_dsa_cache_layer_split=bool(body.get("enable_dsa_cache_layer_split", False)),
        enable_kv_cache_sharding=bool(body.get("enable_kv_cache_sharding", False)),
        has_dsv41_spec_layout=body.get("dsv41_spec_layout") is not None,
        prefill_http_port=_opt(body, "prefill_http_port", int),
    )  # fmt: skip


def parse_rank_endpoint(body: Any, dp_rank: int, tp_rank: int) -> RankEndpoint:
    """`{"rank_ip", "rank_port"}`. Raises ProtocolError."""
    if not isinstance(body, dict) or not isinstance(body.get("rank_ip"), str):
        raise ProtocolError(f"SGLang rank endpoint: expected rank_ip/rank_port, got {body!r:.80}")
    port = _int(body, "rank_port")
    if not 0 < port < 65536:
        raise ProtocolError(f"SGLang rank endpoint: rank_port {port} out of range")
    return RankEndpoint(dp_rank, tp_rank, body["rank_ip"], port)


def check_server_info(info: PrefillServerInfo, compat: ModelCompat) -> None:
    """Refuse a prefill this worker cannot take KV from. Raises IncompatiblePeer."""
    problems = _mismatches(info, compat)
    if problems:
        raise IncompatiblePeer("incompatible SGLang prefill: " + "; ".join(problems))


def _mismatches(info: PrefillServerInfo, compat: ModelCompat) -> list[str]:
    out: list[str] = []
    ps = info.page_size
    if ps is None or ps <= 0 or compat.page_size % ps:
        out.append(f"prefill page_size={ps} must divide this worker's page size "
                   f"{compat.page_size} (prefill --page-size, or cache.page_size here)")
    dtype = info.kv_cache_dtype
    if dtype not in (None, "auto") and _KV_DTYPES.get(dtype, dtype) != compat.dtype:
        out.append(f"prefill kv_cache_dtype={dtype!r} but this worker's KV is {compat.dtype!r} "
                   f"(prefill --kv-cache-dtype auto, or model.dtype here)")
    if info.kv_layout is not None or info.has_dsv41_spec_layout:
        out.append(f"prefill kv_layout={info.kv_layout!r}: only the default NHD layout is "
                   f"supported (unset SGLANG_DSV4_KV_LAYOUT / --dsv4-attn-backend)")
    if info.pp_size != 1 or info.attn_cp_size != 1:
        out.append(f"prefill pp_size={info.pp_size} attn_cp_size={info.attn_cp_size}: only 1 is "
                   f"supported (prefill --pp-size 1, no context parallelism)")
    if info.dp_size > 1 and not info.follow_bootstrap_room:
        out.append(f"prefill dp_size={info.dp_size} without follow_bootstrap_room: the room's "
                   f"rank is unknown here (prefill --load-balance-method follow_bootstrap_room)")
    n = info.attn_tp_size
    if n <= 0 or compat.num_kv_heads % n:
        out.append(f"prefill attn_tp_size={n} does not divide this model's "
                   f"{compat.num_kv_heads} KV heads (prefill --tp-size / --dp-size)")
    if info.decode_allocation_policy != "early":
        out.append(f"prefill decode_allocation_policy={info.decode_allocation_policy!r}, this "
                   f"worker allocates early (--disaggregation-decode-allocation-policy early)")
    if info.enable_dsa_cache_layer_split or info.enable_kv_cache_sharding:
        out.append("prefill splits or shards its KV cache (DSA layer split / KV cache sharding): "
                   "not supported")
    return out


def prefill_dp_rank(info: PrefillServerInfo, room: int) -> int:
    """The prefill DP rank that serves `room`: 0, or room % dp with follow_bootstrap_room."""
    return room % info.dp_size if info.dp_size > 1 else 0


def _int(body: dict[str, Any], key: str, default: int | None = None) -> int:
    value = body.get(key, default)
    if value is None and default is not None:
        value = default
    if isinstance(value, bool) or not isinstance(value, int):
        raise ProtocolError(f"SGLang bootstrap answer: {key}={value!r:.40} is not an int")
    return value


def _opt(body: dict[str, Any], key: str, kind: type) -> Any:
    value = body.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, kind)):
        raise ProtocolError(f"SGLang bootstrap answer: {key}={value!r:.40} is not {kind.__name__}")
    return value
