"""The unary reports of the service: model, server, loads, and the tokenizer bundle.

Each is built from what the HTTP routes report (`backend.server_info()`, `model_info()`,
`load()`, `loads.load_row`), so `/server_info` and `GetServerInfo` never disagree. The model's
`config.json` (in `model_path`) adds what smg reads to pick its pipeline (`model_type`,
`architectures`: smg renders gpt-oss chat with its harmony builder) and the token ids.

`GetTokenizer` streams a zip of the tokenizer files of `tokenizer_path` (as smg's servicers
do: 64 KiB chunks, the archive's SHA-256 hex digest on the last one), so smg needs no local
copy of the model directory. The archive is built once, off the event loop.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import time
import zipfile
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from google.protobuf.struct_pb2 import Struct
from google.protobuf.timestamp_pb2 import Timestamp
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from decode_worker import __version__
from decode_worker.io.api.backend import GenerateBackend, Load
from decode_worker.io.api.loads import disagg_section, load_row

CHUNK_BYTES = 64 * 1024
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "config.json",
                   "generation_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "tokenizer.model", "chat_template.json")
TOKENIZER_GLOBS = ("*.tiktoken", "*.jinja")


def model_config(model_path: str) -> dict[str, Any]:
    """The model directory's config.json ({} when unreadable: the fields stay empty)."""
    try:
        data = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _ints(value: Any) -> list[int]:
    items = value if isinstance(value, list) else [value]
    return [v for v in items if isinstance(v, int) and not isinstance(v, bool)]


def model_info(backend: GenerateBackend, served_model_name: str) -> pb.GetModelInfoResponse:
    info = {**backend.server_info(), **backend.model_info()}
    path = str(info.get("model_path") or "")
    cfg = model_config(path)
    ctx = info.get("context_length")
    ctx = ctx if isinstance(ctx, int) else 0
    tok = backend.tokenizer
    vocab = getattr(tok, "vocab_size", None) or cfg.get("vocab_size") or 0
    return pb.GetModelInfoResponse(
        model_path=path, tokenizer_path=str(info.get("tokenizer_path") or path),
        is_generation=True, served_model_name=served_model_name, max_context_length=ctx,
        vocab_size=int(vocab), model_type=str(cfg.get("model_type") or ""),
        architectures=[str(a) for a in cfg.get("architectures") or []],
        eos_token_ids=list(tok.eos_token_ids) or _ints(cfg.get("eos_token_id")),
        pad_token_id=(_ints(cfg.get("pad_token_id")) or [0])[0],
        bos_token_id=(_ints(cfg.get("bos_token_id")) or [0])[0],
        max_req_input_len=max(ctx - 1, 0), weight_version="default")


def server_info(info: dict[str, Any], *, active_requests: int, started_at: float,
                is_paused: bool) -> pb.GetServerInfoResponse:
    """`info`: what GET /server_info answers (the server's arguments, flat)."""
    args = Struct()
    args.update({k: _plain(v) for k, v in info.items()})
    sched = Struct()
    sched.update({"max_total_num_tokens": _plain(info.get("max_total_num_tokens") or 0),
                  "max_running_requests": _plain(info.get("max_running_requests") or 0),
                  "is_generation": True})
    start = Timestamp()
    start.FromSeconds(int(started_at))
    total = info.get("max_total_num_tokens")
    return pb.GetServerInfoResponse(
        server_args=args, scheduler_info=sched, active_requests=active_requests,
        is_paused=is_paused, uptime_seconds=time.time() - started_at,
        sglang_version=f"decode-worker {__version__}", server_type="grpc", start_time=start,
        max_total_num_tokens=total if isinstance(total, int) else 0)


def _plain(value: Any) -> Any:
    """A value a protobuf Struct holds (numbers, strings, bools, lists, dicts, None)."""
    if value is None or isinstance(value, str | int | float | bool):
        return value
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return str(value)


def loads(load: Load, info: dict[str, Any], include: list[str]) -> pb.GetLoadsResponse:
    """One rank's load, as GET /v1/loads reports it (`include`: the sections; empty = all)."""
    mode = str(info.get("disaggregation_mode") or "null")
    row = load_row(load, info, mode)
    wants = not include or "all" in include
    msg = pb.SchedulerLoad(
        dp_rank=0, num_running_reqs=row["num_running_reqs"],
        num_waiting_reqs=row["num_waiting_reqs"], num_total_reqs=row["num_total_reqs"],
        num_used_tokens=row["num_used_tokens"], max_total_num_tokens=row["max_total_num_tokens"],
        token_usage=row["token_usage"], gen_throughput=0.0, cache_hit_rate=row["cache_hit_rate"],
        utilization=0.0, max_running_requests=row["max_running_requests"],
        num_waiting_uncached_tokens=row["num_waiting_uncached_tokens"])
    if wants or "disagg" in include:
        msg.disaggregation.CopyFrom(pb.DisaggregationMetrics(**{
            k: v for k, v in disagg_section(load, mode).items()
            if k in pb.DisaggregationMetrics.DESCRIPTOR.fields_by_name}))
    if wants or "queues" in include:
        msg.queues.CopyFrom(pb.QueueMetrics())
    agg = pb.AggregateMetrics(
        total_running_reqs=msg.num_running_reqs, total_waiting_reqs=msg.num_waiting_reqs,
        total_reqs=msg.num_total_reqs, avg_token_usage=msg.token_usage)
    return pb.GetLoadsResponse(timestamp=datetime.now(UTC).isoformat(), version=__version__,
                               dp_rank_count=1, loads=[msg], aggregate=agg)


def build_tokenizer_zip(tokenizer_dir: Path) -> tuple[bytes, str]:
    """The zip of the tokenizer files in `tokenizer_dir` and its SHA-256 hex digest. Raises
    FileNotFoundError when there are none."""
    names = [n for n in TOKENIZER_FILES if (tokenizer_dir / n).is_file()]
    names += sorted({p.name for g in TOKENIZER_GLOBS for p in tokenizer_dir.glob(g)
                     if p.is_file()} - set(names))
    if not names:
        raise FileNotFoundError(f"no tokenizer files in {tokenizer_dir}")
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for name in names:
            zf.write(tokenizer_dir / name, name)
    data = buf.getvalue()
    return data, hashlib.sha256(data).hexdigest()


class TokenizerBundle:
    """The tokenizer archive of one directory, built on first use in a worker thread and kept
    (the directory is the model's, fixed for the process's life). A failed build is not kept."""

    def __init__(self, tokenizer_dir: Path) -> None:
        self.tokenizer_dir = tokenizer_dir
        self._archive: tuple[bytes, str] | None = None
        self._lock = asyncio.Lock()

    async def archive(self) -> tuple[bytes, str]:
        async with self._lock:
            if self._archive is None:
                self._archive = await asyncio.to_thread(build_tokenizer_zip, self.tokenizer_dir)
            return self._archive


def tokenizer_chunks(data: bytes, sha256: str) -> Iterator[common_pb2.GetTokenizerChunk]:
    """`data` in chunks of at most CHUNK_BYTES; the digest rides on the last one only."""
    for start in range(0, len(data), CHUNK_BYTES):
        end = min(start + CHUNK_BYTES, len(data))
        yield common_pb2.GetTokenizerChunk(data=data[start:end],
                                           sha256=sha256 if end == len(data) else "")
