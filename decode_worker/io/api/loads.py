"""GET /v1/loads: SGLang's load report, the one the SGLang Model Gateway (smg) polls.

smg's load monitor asks `GET /v1/loads?include=core,disagg,queues,memory` every
`--load-monitor-interval` seconds (after a 404 from `/loads`, which only a gateway serves) and
feeds `cache_aware`, `power_of_two`, `least_load` and worker overload protection from it. A 404
here makes it fall back to `/metrics` gauges named `sglang_token_usage`, which this worker does
not export, so it would route blind. The body is SGLang 0.5.23's shape:

    {"timestamp": ISO-8601 str, "version": str, "accelerator": null, "num_accelerators": 1,
     "loads": [{"dp_rank": 0, "num_running_reqs", "num_waiting_reqs", ...,
                "disaggregation": {...}, "queues": {...}}]}

Counts are JSON integers and ratios floats (smg reads them into i32 / f64 and memoizes a body
it cannot parse as "no load route"). `include` (comma-separated: core, memory, spec, lora,
disagg, queues, all; default all) picks the sections; sections this worker has nothing for
(memory, spec, lora) are left out, as SGLang leaves out a section it does not have. `dp_rank`
other than 0 and `format` other than json are a 400 naming the value. Open like /get_load.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any
from urllib.parse import parse_qs

from decode_worker import __version__
from decode_worker.errors import ClientError
from decode_worker.io.api.backend import Load
from decode_worker.io.api.context import ApiContext
from decode_worker.io.api.message import Request, Response

SECTIONS = frozenset({"core", "memory", "spec", "lora", "disagg", "queues", "all"})


async def handle_v1_loads(app: ApiContext, req: Request) -> Response:
    include = parse_include(req.query)
    info, load = app.backend.server_info(), app.backend.load()
    mode = str(info.get("disaggregation_mode") or "null")
    row = load_row(load, info, mode)

    def wants(section: str) -> bool:
        return include is None or "all" in include or section in include

    if wants("disagg"):
        row["disaggregation"] = disagg_section(load, mode)
    if wants("queues"):
        row["queues"] = {"waiting": 0, "grammar": 0, "paused": 0, "retracted": 0,
                         "prealloc_ready": 0}
    return Response.json({
        "timestamp": datetime.now(UTC).isoformat(), "version": __version__,
        "accelerator": None, "num_accelerators": 1, "loads": [row],
    })


def parse_include(query: str) -> set[str] | None:
    """The `include` sections asked for (None: all). Raises ClientError for an unknown section,
    a `dp_rank` other than 0 (one rank here) or a `format` other than json."""
    params = parse_qs(query)
    for rank in params.get("dp_rank", []):
        if rank.strip() != "0":
            raise ClientError(f"dp_rank {rank[:20]!r} does not exist: this worker has dp_rank 0")
    for fmt in params.get("format", []):
        if fmt not in ("json", ""):
            raise ClientError(f"format {fmt[:20]!r} is not served: only json (Prometheus "
                              "gauges are on /metrics)")
    values = params.get("include")
    if not values:
        return None
    asked = {s.strip() for v in values for s in v.split(",") if s.strip()}
    unknown = asked - SECTIONS
    if unknown:
        raise ClientError(f"invalid include sections: {sorted(unknown)}; valid options: "
                          f"{sorted(SECTIONS)}")
    return asked


def load_row(load: Load, info: dict[str, Any], mode: str) -> dict[str, Any]:
    """The `core` fields of one rank (`mode`: /server_info's disaggregation_mode). `token_usage`
    is tokens held by requests over the KV capacity (`max_total_num_tokens` from /server_info;
    0 when unknown), as SGLang counts it: the evictable prefix cache is free room, not usage."""
    decode = mode == "decode"
    capacity = _int(info.get("max_total_num_tokens"))
    usage = min(1.0, load.num_used_tokens / capacity) if capacity > 0 else 0.0
    return {
        "timestamp": load.measured_at, "dp_rank": 0,
        "num_running_reqs": load.num_running_reqs, "num_waiting_reqs": load.num_waiting_reqs,
        "num_waiting_uncached_tokens": load.num_queued_tokens,
        "num_used_tokens": load.num_used_tokens, "num_total_tokens": load.num_tokens,
        "max_total_num_tokens": capacity,
        "max_running_requests": _int(info.get("max_running_requests")),
        "token_usage": round(usage, 6), "gen_throughput": 0.0,
        "cache_hit_rate": round(load.cache_hit_rate, 6), "utilization": 0.0,
        # smg's flat names for what SGLang nests under "disaggregation"
        "num_total_reqs": load.num_running_reqs + load.num_waiting_reqs,
        "disagg_mode": mode, "decode_queue_reqs": load.num_waiting_reqs if decode else 0,
        "prefill_queue_reqs": load.num_running_reqs if mode == "prefill" else 0,
    }


def disagg_section(load: Load, mode: str) -> dict[str, Any]:
    """SGLang's DisaggregationMetrics: the decode queues (prealloc: waiting for pages; transfer:
    waiting for KV). Transfer speed and latency are on /metrics, not here (0.0)."""
    decode = mode == "decode"
    return {
        "mode": mode, "prefill_bootstrap_queue_reqs": 0,
        "prefill_inflight_queue_reqs": load.num_running_reqs if mode == "prefill" else 0,
        "decode_prealloc_queue_reqs": load.num_prealloc_reqs if decode else 0,
        "decode_transfer_queue_reqs": load.num_transfer_reqs if decode else 0,
        "decode_retracted_queue_reqs": 0, "kv_transfer_speed_gb_s": 0.0,
        "kv_transfer_latency_ms": 0.0,
    }


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0
