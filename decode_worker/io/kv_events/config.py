"""Endpoints of SGLang's KV-event publisher and `/server_info`'s `kv_events`, for the
configuration `settings.kv_events` parsed at load (`settings/kv_events.py`)."""

from __future__ import annotations

from typing import Any

from decode_worker.settings.kv_events import KvEventsConfig


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
