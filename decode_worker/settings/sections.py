"""Typed settings, grouped by concern (the sections and their keys).

Sources, lowest priority first:
  1. defaults (the field defaults below);
  2. a TOML file (`--config FILE`), sections named as below;
  3. environment: `DECODE_WORKER_<SECTION>__<KEY>` (e.g. `DECODE_WORKER_CACHE__PAGE_SIZE=64`), and
     the plain switches `ENABLE_UNIFIED_RADIX_TREE` / `SGLANG_ENABLE_UNIFIED_RADIX_TREE`
     (the `DECODE_WORKER_` form wins if both are set);
  4. CLI overrides (`--set section.key=value` and the named flags such as `--port`).

Runtime facts (how many pages fit in memory) live in the device layer's `CacheLayout`, never here.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, SecretStr, field_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from decode_worker.errors import ConfigError
from decode_worker.settings.kv_events import KvEventsConfig, parse_kv_events_config
from decode_worker.settings.speculative import SpeculativeSettings

ENV_PREFIX = "DECODE_WORKER_"
UNIFIED_TREE_VARS = ("ENABLE_UNIFIED_RADIX_TREE", "SGLANG_ENABLE_UNIFIED_RADIX_TREE")


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


class ModelSettings(_Section):
    """Which model to serve and how to hold its weights."""

    path: Path | None = Field(
        None, description="Local Hugging Face directory; unset = the embedded tiny gpt-oss"
    )
    served_model_name: str | None = Field(
        None, description="Name both servers report and accept; unset = the model path"
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weight/activation dtype; auto = float32 on CPU, bfloat16 on CUDA"
    )
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto = cuda if present")
    attention_backend: Literal["auto", "triton", "torch"] = Field(
        "auto", description="Decode attention: triton = the paged Triton kernel (CUDA only), "
        "torch = the reference path; auto = triton on CUDA when triton imports, else torch"
    )
    moe_backend: Literal["auto", "triton", "torch"] = Field(
        "auto", description="Routed experts: triton = fused Triton MoE kernel (MXFP4 experts kept "
        "on the GPU), torch = torch ops (MXFP4 dequantized at load); auto = triton on CUDA when "
        "triton imports, else torch"
    )
    cache_dir: Path = Field(
        Path.home() / ".cache" / "decode-worker",
        description="Where the embedded default model is written once",
    )
    seed: int = Field(0, description="Seed of the embedded default model's random weights")


class CacheSettings(_Section):
    """KV pools and the decode-side radix cache."""

    page_size: int = Field(16, gt=0, description="Tokens per KV page (both pools)")
    decode_radix_cache: bool = Field(True, description="Reuse full-attention KV across requests")
    unified_radix_tree: bool = Field(
        True, description="One tree with full and SWA values (env ENABLE_UNIFIED_RADIX_TREE)"
    )
    hierarchical_cache: bool | None = Field(
        None, description="Host-memory tier of full-attention KV under the decode radix tree "
        "(SGLang's --enable-hierarchical-cache); unset = on where the decode radix cache is on"
    )
    hicache_ratio: float = Field(
        2.0, gt=0.0, description="Host pages per device full page (SGLang's --hicache-ratio); "
        "the derived size is capped at half the host's available memory (logged)"
    )
    hicache_size_gb: float | None = Field(
        None, gt=0.0, description="Host tier size in GB (1e9 bytes); overrides hicache_ratio; "
        "more than the available host memory is a start-up error"
    )
    hicache_write_policy: Literal["write_through", "write_through_selective", "write_back"] = (
        Field("write_through", description="When full KV is copied to the host tier: on insert, "
              "on the second use, or at device eviction (SGLang's --hicache-write-policy)")
    )
    num_full_pages: int | None = Field(None, gt=0, description="Full pool size; unset = derived")
    num_swa_pages: int | None = Field(None, gt=0, description="SWA pool size; unset = derived")
    memory_fraction: float = Field(
        0.85, gt=0.0, le=1.0, description="Share of the device's total memory this process may "
        "hold: weights, pools, CUDA graphs, activation headroom (CUDA; processes sharing a card "
        "need shares that add up to at most 1)"
    )
    cpu_pool_bytes: int = Field(
        256 * 2**20, gt=0, description="Bytes for both pools together when running on CPU"
    )
    swa_pool_share: float = Field(
        0.25, gt=0.0, lt=1.0, description="Share of pool bytes given to the SWA pool when derived"
    )
    kv_dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="KV pool dtype; auto = the model dtype"
    )


class SchedulerSettings(_Section):
    """Prealloc queue, admission and the decode batch."""

    max_running_requests: int = Field(64, gt=0, description="Largest decode batch")
    max_queued_requests: int = Field(1024, gt=0, description=(
        "Requests waiting to start (peer lookup, prealloc queue, KV transfer; running ones "
        "not counted); past it 503 queue_full"))
    max_prompt_tokens: int | None = Field(None, gt=0, description="Longer prompts get 413")
    default_max_new_tokens: int = Field(
        128, gt=0, description="When a request gives none and the model reports no context length"
    )
    queue_timeout_s: float = Field(60.0, gt=0, description="Deadline to get pages, then abort")
    kv_timeout_s: float = Field(30.0, gt=0, description="Deadline for KV to arrive, then abort")
    decode_reserve_tokens: int = Field(
        256, ge=0, description="Decode growth each admitted request keeps free pages for"
    )
    integrity_check_interval_s: float = Field(
        0.0, ge=0, description="Check pages and locks this often when no batch runs (0 = off); "
        "a broken invariant stops the worker"
    )
    cuda_graph: bool = Field(True, description="Capture the decode step in CUDA graphs (GPU)")
    overlap_schedule: bool = Field(
        True, description="Prepare decode step N+1 (admission, pages, inputs) while step N runs "
        "on the device, its input tokens read on the device; false runs each step to the end "
        "first. Greedy tokens are the same either way"
    )
    cuda_graph_batch_sizes: list[int] = Field(
        [1, 2, 4, 8, 16, 24, 32, 48, 64], description="Graph buckets; eager above the largest"
    )
    cuda_graph_capture_tokens: int = Field(
        8192, ge=0, description="At start-up, capture the graphs of every batch bucket for "
        "contexts up to this many tokens; longer ones are captured on first use (0 = all then). "
        "With the Triton attention one graph per batch bucket serves every context"
    )

    @field_validator("cuda_graph_batch_sizes")
    @classmethod
    def _sorted_positive(cls, sizes: list[int]) -> list[int]:
        if not sizes or any(s <= 0 for s in sizes):
            raise ValueError("must be a non-empty list of positive batch sizes")
        return sorted(set(sizes))


class TransferSettings(_Section):
    """KV transfer over NIXL and the prefill control plane (ZMQ)."""

    backend: str = Field("UCX", description="NIXL backend plugin")
    bootstrap_host: str = Field("127.0.0.1", description="Prefill peer: ZMQ bind address")
    bootstrap_port: int = Field(
        8998, ge=0, lt=65536,
        description="Prefill peer: ZMQ port (0 = any free port, see --ports-file)")
    heartbeat_interval_s: float = Field(0.5, gt=0, description="Peer liveness ping period")
    peer_dead_after_s: float = Field(
        2.0, gt=0, description="A ping unanswered this long = peer gone (a dead peer is found "
        "within heartbeat_interval_s + peer_dead_after_s)"
    )
    progress_delay_us: int = Field(
        100, ge=0, le=100_000, description="NIXL progress thread: longest sleep between polls "
        "(it wakes on transfer events); 0 = busy-poll, a core per process even when idle"
    )
    abort_quiesce_s: float = Field(
        10.0, gt=0, description="Pages of an aborted transfer wait this long for the peer's ack"
    )
    peer_protocol: Literal["auto", "native", "sglang"] = Field(
        "auto", description="Decode worker: the protocol of a request's prefill peer; auto asks "
        "its bootstrap address (an SGLang bootstrap server answers GET /route, a native peer "
        "with a ZMQ greeting) and keeps the answer until the peer is dropped as dead; a peer "
        "that does not answer decides nothing (its requests fail with peer_dead at once)"
    )
    prefill_protocol: Literal["native", "sglang"] = Field(
        "native", description="Prefill peer: the protocol it serves on bootstrap_port: native "
        "(ZMQ) or sglang (SGLang 0.5.23's HTTP bootstrap server, ZMQ frames, NIXL writes)"
    )
    prefill_rank_port: int = Field(
        0, ge=0, lt=65536, description="Prefill peer, sglang protocol: its rank's ZMQ PULL port "
        "(0 = any free port)"
    )
    sglang_landing_tokens: int = Field(
        8192, ge=0, description="Decode worker, a model SGLang lays out with full KV in every "
        "layer (Gemma 3) and SGLang prefills (peer_protocol auto or sglang): tokens of every "
        "layer the landing area holds for the transfers in flight, whose windows are then "
        "copied into the pools; its bytes come out of the derived pool budget. A transfer "
        "waits for room; one whose new tokens exceed this fails; 0 = refuse such transfers"
    )
    kv_checksum: bool = Field(
        False, description="Decode worker: ask native prefill peers for a CRC-32 of the KV pages "
        "of each transfer and check it before the request starts (DRAM pools only; SGLang's "
        "protocol has no checksum)"
    )


class ServerSettings(_Section):
    """HTTP front end and lifecycle."""

    host: str = Field("127.0.0.1", description="Bind address (loopback by default)")
    port: int = Field(30000, ge=0, lt=65536,
                      description="HTTP port (0 = any free port, see --ports-file)")
    drain_announce_s: float = Field(
        6.0, ge=0, description="SIGTERM: first this long /health answers 503 while the worker "
        "still serves, so routers' health checks take it out of rotation before it refuses "
        "work (more than the router's health-check interval x failure threshold); then the "
        "drain grace"
    )
    grpc_port: int | None = Field(
        None, ge=0, lt=65536, description="smg's gRPC worker protocol (SglangScheduler) on this "
        "port beside HTTP, same host; unset = off, 0 = a free port chosen at start (logged, "
        "and in --ports-file)"
    )
    drain_grace_s: float = Field(30.0, ge=0, description="SIGTERM: time for running requests")
    max_body_bytes: int = Field(8 * 2**20, gt=0, description="Larger request bodies get 413")
    api_key: SecretStr | None = Field(None, description="Bearer token required if set")
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field("INFO", description="Logging")
    grpc_require_api_key: bool = Field(
        True, description="With `api_key` set, gRPC calls that serve or change work (Generate, "
        "Abort, FlushCache, SubscribeKvEvents) need metadata `authorization: Bearer <key>`; "
        "false exempts the gRPC port (smg 1.13 sends no credentials over gRPC: fence the port "
        "instead)"
    )


class MetricsSettings(_Section):
    """Prometheus exposition on GET /metrics."""

    enabled: bool = Field(True, description="Serve /metrics")


class ApiSettings(_Section):
    """What the HTTP API accepts beyond the generation fields."""

    strict_model_name: bool = Field(
        True, description="A request naming a model other than the served name gets 404"
    )
    reasoning_parser: Literal["auto", "gpt-oss", "qwen3", "none"] = Field(
        "auto", description="Chat: reasoning as message.reasoning_content: the harmony "
        "analysis channel (gpt-oss) or Qwen3's <think> block (qwen3); auto: the format the "
        "tokenizer's special tokens show; a named one the tokenizer lacks stops the start"
    )
    tool_call_parser: Literal["auto", "gpt-oss", "qwen25", "qwen", "llama3", "none"] = Field(
        "auto", description="Chat: tools accepted and tool calls returned as message.tool_calls:"
        " harmony (gpt-oss), Qwen's <tool_call> JSON (qwen25, qwen) or Llama 3.x JSON (llama3);"
        " auto: the format the tokenizer's special tokens show"
    )
    system_start_date: datetime.date | None = Field(
        None, description="The conversation start date chat templates get from strftime_now "
        "(gpt-oss: the harmony system message's date), YYYY-MM-DD. Unset: the UTC date at "
        "start-up, kept for the life of the process. Prefill and decode render every prompt "
        "separately and must agree: set the same value on both (vLLM's VLLM_SYSTEM_START_DATE)"
    )


class KvEventsSettings(_Section):
    """KV events of the decode radix tree, configured as SGLang's `--kv-events-config`."""

    config: str | None = Field(
        None, description="SGLang's --kv-events-config JSON (publisher zmq|null, endpoint, topic, "
        "replay_endpoint, buffer_steps, hwm, max_queue_size, bind, format): publisher zmq opens "
        "the ZMQ publisher. Unset (the default): no socket, but with server.grpc_port set the "
        "decode worker still streams its events over gRPC (SubscribeKvEvents, for smg) from the "
        "in-process log; publisher null: no events at all, as in SGLang"
    )

    _parsed: KvEventsConfig = PrivateAttr(default_factory=KvEventsConfig)

    @field_validator("config", mode="before")
    @classmethod
    def _json_text(cls, value: Any) -> Any:
        if isinstance(value, dict):  # `--set kv_events.config={...}` arrives parsed
            value = json.dumps(value)
        try:
            parse_kv_events_config(value)
        except ConfigError as exc:
            raise ValueError(str(exc)) from None
        return value

    def model_post_init(self, context: Any) -> None:
        self._parsed = parse_kv_events_config(self.config)  # valid: checked above

    @property
    def parsed(self) -> KvEventsConfig:
        """The configuration, parsed once at load (the text stays for `decode-worker config`)."""
        return self._parsed

    def keeps_event_log(self, grpc_port: int | None) -> bool:
        """A decode worker (radix cache on) keeps a KV-event log: with the zmq publisher, or,
        `config` unset, with the gRPC port on (SubscribeKvEvents streams the in-process log);
        publisher "null" keeps events off, as in SGLang."""
        if self.config is None or not self.config.strip():
            return grpc_port is not None
        return self._parsed.enabled


class Settings(BaseSettings):
    """All settings. Build with `load_settings`, which also records each value's source."""

    model_config = SettingsConfigDict(extra="forbid", frozen=True)

    model: ModelSettings = ModelSettings()
    cache: CacheSettings = CacheSettings()
    scheduler: SchedulerSettings = SchedulerSettings()
    transfer: TransferSettings = TransferSettings()
    server: ServerSettings = ServerSettings()
    metrics: MetricsSettings = MetricsSettings()
    api: ApiSettings = ApiSettings()
    kv_events: KvEventsSettings = KvEventsSettings()
    speculative: SpeculativeSettings = SpeculativeSettings()

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # load_settings merges the sources itself (to know where each value came from).
        return (init_settings,)
