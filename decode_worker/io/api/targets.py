"""Where each sample's KV comes from: the router's P/D fields spread over a request's samples.

sglang-router (PD mode) adds `bootstrap_host`, `bootstrap_port` and `bootstrap_room` to every
body it sends: scalars, or arrays for an array prompt (0.3.2 sends one room for `n > 1`).
`sample_targets` turns them into one `Target` per sample (see `samples.py` for the order).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from decode_worker.errors import ClientError
from decode_worker.io.api.schemas import Bootstrap


@dataclass(frozen=True, slots=True)
class Target:
    """Where one sample's KV comes from: the prefill peer's host, bootstrap port and room
    (all None when the request came without the router's P/D fields)."""

    host: str | None = None
    port: int | None = None
    room: int | None = None


def sample_targets(boot: Bootstrap, num_prompts: int, n: int) -> list[Target]:
    """One `Target` per sample (`num_prompts * n`, sample k = prompt k // n, its sample k % n).

    Each field may be a scalar, an array with one entry per sample, or one per prompt:
    - a scalar host or port serves every sample; a scalar room R gives sample k the room R + k
      (SGLang's own rule: sglang-router 0.3.2 sends one room for `n > 1`);
    - one entry per prompt (the router's arrays for a batch of prompts with `n > 1`): sample j
      of prompt i gets entry i (a room: entry i + j);
    - a one-sample request with arrays uses entry 0 (the router reads a token-id `prompt` list
      as a batch of that many prompts).
    Both servers apply these rules to the same body, so they agree. Raises ClientError."""
    total = num_prompts * n
    room = boot.bootstrap_room
    rooms = _column(room, "bootstrap_room", num_prompts, n)
    if isinstance(room, int):  # one room for all samples: R + k
        rooms = [room + k for k in range(total)]
    elif isinstance(room, list) and len(room) != total and total > 1:  # one per prompt: + j
        rooms = [r + k % n for k, r in enumerate(rooms)]
    targets = [Target(*row) for row in zip(
        _column(boot.bootstrap_host, "bootstrap_host", num_prompts, n),
        _column(boot.bootstrap_port, "bootstrap_port", num_prompts, n), rooms, strict=True)]
    for t in targets:
        _check_target(t)
    return targets


def _column(value: Any, name: str, num_prompts: int, n: int) -> list[Any]:
    """`value` spread over the samples: a scalar to all, one entry per sample, or one per
    prompt (repeated for its n samples). Raises ClientError for another length."""
    total = num_prompts * n
    if not isinstance(value, list):
        return [value] * total
    if len(value) == total or (total == 1 and value):
        return list(value[:total])
    if len(value) == num_prompts:
        return [value[k // n] for k in range(total)]
    raise ClientError(f"{name} has {len(value)} entries for {total} samples (one per sample, "
                      f"or one per prompt: {num_prompts} prompt(s) x n={n})")


def _check_target(t: Target) -> None:
    """Raise ClientError for a room or port outside their ranges."""
    if t.room is not None and not 0 <= t.room < 2**64:
        raise ClientError(f"bootstrap_room={t.room}: must be in [0, 2**64)")
    if t.port is not None and not 0 < t.port < 65536:
        raise ClientError(f"bootstrap_port={t.port}: must be in (0, 65536)")
