"""SGLang's `--kv-events-config` JSON (sglang 0.5.23 `KVEventsConfig`), validated at start-up.

Same keys and defaults as SGLang: `publisher` ("null" = no socket, the default; "zmq"), `endpoint`
(`tcp://*:5557`), `bind` (None: bind wildcard/ipc/inproc endpoints, connect otherwise),
`replay_endpoint`, `buffer_steps`, `hwm`, `max_queue_size`, `topic`, `format`. Unlike SGLang, a
bad value or an unknown key stops the daemon with one line naming the key (SGLang fails later,
or ignores unknown keys); `format` "dynamo" only changes namespaced (salted/LoRA) hashes, which
this worker never has, so both formats publish the same hashes. Unset, a decode worker with
its gRPC port on still keeps the event log for SubscribeKvEvents (`keeps_event_log`).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from decode_worker.errors import ConfigError


class KvEventsConfig(BaseModel):
    """One publisher's configuration (see module docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    publisher: Literal["null", "zmq"] = "null"
    endpoint: str = "tcp://*:5557"
    bind: bool | None = None
    replay_endpoint: str | None = None
    buffer_steps: int = Field(10_000, gt=0)
    hwm: int = Field(100_000, ge=0)
    max_queue_size: int = Field(100_000, gt=0)
    topic: str = ""
    format: Literal["default", "dynamo"] = "default"

    @property
    def enabled(self) -> bool:
        return self.publisher == "zmq"

    def should_bind(self) -> bool:
        """SGLang's rule: `bind` if set, else bind wildcard, ipc:// and inproc:// endpoints."""
        if self.bind is not None:
            return self.bind
        ep = self.endpoint
        return ("*" in ep or "::" in ep or "0.0.0.0" in ep
                or ep.startswith(("ipc://", "inproc://")))


def parse_kv_events_config(raw: str | dict[str, Any] | None,
                           where: str = "kv_events.config") -> KvEventsConfig:
    """Parse the JSON text (or an already parsed object); '' / None: publishing off.
    Raises `ConfigError` naming `where` and the bad key."""
    if raw is None or (isinstance(raw, str) and not raw.strip()):
        return KvEventsConfig()
    try:
        data = json.loads(raw) if isinstance(raw, str) else raw
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{where}: not valid JSON ({exc.msg} at char {exc.pos})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a JSON object, got {type(data).__name__}")
    try:
        return KvEventsConfig.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        key = ".".join(str(p) for p in err["loc"]) or "?"
        if err["type"] == "extra_forbidden":
            allowed = ", ".join(KvEventsConfig.model_fields)
            raise ConfigError(f"{where}: unknown key {key!r} (keys: {allowed})") from None
        value = data.get(key, "<missing>")
        raise ConfigError(f"{where}: key {key!r}={value!r}: {err['msg']}") from None


def keeps_event_log(raw: str | dict[str, Any] | None, grpc_port: int | None) -> bool:
    """Whether a decode worker (with its radix cache on) keeps a KV-event log: when `raw`
    configures the zmq publisher, or when `raw` is unset and the gRPC port is on (smg's
    SubscribeKvEvents then streams the in-process log, no socket); an explicit publisher
    "null" keeps events off, as in SGLang. Raises `ConfigError` as `parse_kv_events_config`."""
    if raw is None or (isinstance(raw, str) and not raw.strip()):
        return grpc_port is not None
    return parse_kv_events_config(raw).enabled


def offset_endpoint_port(endpoint: str | None, rank: int) -> str | None:
    """SGLang's `offset_endpoint_port`: tcp port + rank, inproc `_dp{rank}`; rank 0 unchanged."""
    if not endpoint or rank == 0:
        return endpoint
    if "inproc" in endpoint:
        return f"{endpoint}_dp{rank}"
    return with_port(endpoint, int(endpoint.rpartition(":")[2]) + rank)


def with_port(endpoint: str, port: int) -> str:
    """`endpoint` (`tcp://host:port`) with its port replaced by `port`."""
    head, _, _ = endpoint.rpartition(":")
    return f"{head}:{port}"


def tcp_host_port(endpoint: str | None) -> tuple[str, int] | None:
    """(host, port) of a routable `tcp://host:port` (IPv6 bracketed), else None."""
    if not endpoint or not endpoint.startswith("tcp://"):
        return None
    host, sep, port = endpoint[len("tcp://"):].rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535:
        return None
    if ":" in host and not host.startswith("["):
        return None  # a bare IPv6 host is ambiguous (SGLang rejects it too)
    return host, int(port)


def describe(cfg: KvEventsConfig, block_size: int, dp_size: int = 1) -> dict[str, Any] | None:
    """`/server_info`'s `kv_events` as SGLang 0.5.23 reports it (`describe_kv_events_publisher`):
    None when off, page size unknown, or the endpoint is not a routable tcp address."""
    resolved = tcp_host_port(cfg.endpoint) if cfg.enabled else None
    if resolved is None or block_size <= 0:
        return None
    out: dict[str, Any] = {"publisher": cfg.publisher, "endpoint_host": resolved[0],
                           "endpoint_port_base": resolved[1], "topic": cfg.topic,
                           "block_size": block_size, "dp_size": dp_size}
    replay = tcp_host_port(cfg.replay_endpoint)
    if replay is not None:
        out["replay_endpoint_port_base"] = replay[1]
    return out
