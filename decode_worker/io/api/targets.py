"""Where each sample's KV comes from: the router's P/D fields spread over a request's samples.

sglang-router (PD mode) adds `bootstrap_host`, `bootstrap_port` and `bootstrap_room` to every
body it sends: scalars, or arrays for an array prompt (0.3.2 sends one room for `n > 1`).
`sample_targets` turns them into one `Target` per sample (see `samples.py` for the order).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

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


class _Sent(msgspec.Struct):
    """What a refused body may say about its samples, any type accepted (`body_targets`)."""

    bootstrap_host: Any = None
    bootstrap_port: Any = None
    bootstrap_room: Any = None
    n: Any = None
    sampling_params: Any = None  # /generate: `n` is in here
    text: Any = None  # /generate
    input_ids: Any = None  # /generate
    prompt: Any = None  # /v1/completions


def body_targets(raw: bytes) -> list[Target]:
    """The samples' targets of a generation body that is being refused, for `refuse` (best
    effort, never raises): one per sample by `sample_targets`' rules when the body still says
    how many prompts and samples it has, else one per room it names; [] when it names no
    prefill peer and room, or is not a JSON object."""
    try:
        sent = msgspec.json.decode(raw, type=_Sent)
    except msgspec.MsgspecError:
        return []
    if sent.bootstrap_host is None or sent.bootstrap_room is None:
        return []
    sp = sent.sampling_params if isinstance(sent.sampling_params, dict) else {}
    n = sent.n if sent.n is not None else sp.get("n", 1)
    batch = next((v for v in (sent.text, sent.input_ids, sent.prompt) if v is not None), None)
    num_prompts = len(batch) if isinstance(batch, list) and batch and (
        not isinstance(batch[0], int)) else 1
    boot = Bootstrap(sent.bootstrap_host, sent.bootstrap_port, sent.bootstrap_room)
    try:
        if not isinstance(n, int) or not 0 < n * num_prompts <= 1024:
            raise ClientError("no sample count")
        targets = sample_targets(boot, num_prompts, n)
    except (ClientError, TypeError, ValueError):
        targets = [Target(*row) for row in zip(*(
            v if isinstance(v, list) else [v] * _longest(boot)
            for v in (boot.bootstrap_host, boot.bootstrap_port, boot.bootstrap_room)),
            strict=False)]
    return [t for t in targets if _is_target(t)]


def _longest(boot: Bootstrap) -> int:
    cols = (boot.bootstrap_host, boot.bootstrap_port, boot.bootstrap_room)
    return max((len(v) for v in cols if isinstance(v, list)), default=1)


def _is_target(t: Target) -> bool:
    """A usable peer address and room (a port of None: the worker's default)."""
    return (isinstance(t.host, str) and bool(t.host) and type(t.room) is int
            and 0 <= t.room < 2**64 and (t.port is None or (
                type(t.port) is int and 0 < t.port < 65536)))
