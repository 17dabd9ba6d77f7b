"""Request bodies (msgspec): SGLang `/generate` and the OpenAI completions/chat shapes.

Unknown fields are accepted and ignored (the router adds many). Type errors surface as
`msgspec.ValidationError`, which the app answers 400 with msgspec's message (it names the field).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec

from decode_worker.core.sampling import SamplingParams
from decode_worker.errors import ClientError

T = TypeVar("T")


class SamplingIn(msgspec.Struct):
    """SGLang `sampling_params`; None means "the default"."""

    max_new_tokens: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    seed: int | None = None
    sampling_seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    no_stop_trim: bool = False
    skip_special_tokens: bool = True
    n: int = 1


class Bootstrap(msgspec.Struct):
    """The router's P/D fields, shared by every generation body: scalars for one sample, arrays
    with one entry per sample for `n > 1` or an array prompt (see `sample_targets`)."""

    bootstrap_host: str | list[str] | None = None
    bootstrap_port: int | list[int] | None = None
    bootstrap_room: int | list[int] | None = None


class GenerateReq(Bootstrap):
    text: str | list[str] | None = None
    input_ids: list[Any] | None = None  # token ids, or a batch of token id lists
    sampling_params: SamplingIn | None = None
    stream: bool = False
    rid: str | list[str] | None = None
    return_logprob: bool = False
    top_logprobs_num: int | None = None


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class OpenAIBase(Bootstrap):
    """Fields common to /v1/completions and /v1/chat/completions."""

    model: str | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    no_stop_trim: bool = False
    skip_special_tokens: bool = True
    rid: str | None = None


class CompletionReq(OpenAIBase):
    prompt: str | list[Any] | None = None
    logprobs: int | None = None
    echo: bool = False


class ContentPart(msgspec.Struct):
    type: str = "text"
    text: str | None = None


class Message(msgspec.Struct):
    role: str
    content: str | list[ContentPart] | None = None


class ChatReq(OpenAIBase):
    messages: list[Message] = msgspec.field(default_factory=list)
    logprobs: bool = False
    top_logprobs: int | None = None


def decode_body(body: bytes, kind: type[T]) -> T:
    """Parse a JSON body. Raises ClientError (400) naming what is wrong."""
    if not body.strip():
        raise ClientError("request body is empty; expected a JSON object")
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        raise ClientError(f"invalid request: {exc}") from None
    except msgspec.DecodeError as exc:
        raise ClientError(f"malformed JSON: {exc}") from None


def _stop_tuple(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)


def build_sampling(
    *,
    max_new_tokens: int,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    seed: int | None = None,
    stop: str | list[str] | None = None,
    stop_token_ids: list[int] | None = None,
    ignore_eos: bool = False,
    no_stop_trim: bool = False,
    skip_special_tokens: bool = True,
) -> SamplingParams:
    """SamplingParams from request fields, validated. Raises ClientError (400)."""
    params = SamplingParams(
        max_new_tokens=max_new_tokens,
        temperature=1.0 if temperature is None else temperature,
        top_k=-1 if top_k is None else top_k,
        top_p=1.0 if top_p is None else top_p,
        min_p=0.0 if min_p is None else min_p,
        seed=seed,
        stop=_stop_tuple(stop),
        stop_token_ids=tuple(stop_token_ids or ()),
        ignore_eos=ignore_eos,
        no_stop_trim=no_stop_trim,
        skip_special_tokens=skip_special_tokens,
    )
    params.validate()
    return params


def sampling_from_generate(sp: SamplingIn, max_new_tokens: int) -> SamplingParams:
    """`max_new_tokens` is the resolved limit (`limits.resolve_max_new_tokens`)."""
    return build_sampling(
        max_new_tokens=max_new_tokens,
        temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k, min_p=sp.min_p,
        seed=sp.seed if sp.seed is not None else sp.sampling_seed, stop=sp.stop,
        stop_token_ids=sp.stop_token_ids, ignore_eos=sp.ignore_eos, no_stop_trim=sp.no_stop_trim,
        skip_special_tokens=sp.skip_special_tokens,
    )


def requested_max_tokens(req: OpenAIBase) -> int | None:
    """`max_completion_tokens` wins over `max_tokens` (the router renames the latter)."""
    return req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens


def sampling_from_openai(req: OpenAIBase, max_new_tokens: int) -> SamplingParams:
    """`max_new_tokens` is the resolved limit (`limits.resolve_max_new_tokens`)."""
    return build_sampling(
        max_new_tokens=max_new_tokens,
        temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
        seed=req.seed, stop=req.stop, stop_token_ids=req.stop_token_ids,
        ignore_eos=req.ignore_eos, no_stop_trim=req.no_stop_trim,
        skip_special_tokens=req.skip_special_tokens,
    )


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
