"""What every generation route checks before anything is queued: the model's context length
and the model name. Both servers (decode worker, prefill peer) run these same checks on the same
body (the router sends it to both), so they answer alike.

Context length (SGLang/vLLM semantics), `ctx` = the model's max_position_embeddings:
- a prompt of `ctx` tokens or more leaves no room for an output token: 400;
- `prompt_tokens + max_new_tokens > ctx`: 400 naming both numbers and the limit;
- `max_new_tokens` omitted: `/generate` and chat run up to the context (`ctx - prompt_tokens`),
  completions default to 16 tokens (OpenAI's and SGLang's `max_tokens` default), capped at
  the room left.
A backend that reports no `context_length` gets none of these checks; an omitted
`max_new_tokens` is then the configured default.
"""

from __future__ import annotations

from decode_worker.errors import ClientError

COMPLETIONS_DEFAULT_MAX_TOKENS = 16


class ModelNotFound(ClientError):
    """A request named a model this server does not serve (vLLM answers 404)."""

    status = 404
    reason = "model_not_found"


def check_model(requested: str | None, served: str, strict: bool) -> None:
    """Raise ModelNotFound when `strict` and the request names a model other than `served`
    (no `model` field is always fine)."""
    if not strict or requested is None or requested == served:
        return
    raise ModelNotFound(f"The model `{requested}` does not exist. "
                        f"This server serves: [`{served}`]")


def resolve_max_new_tokens(
    prompt_tokens: int, requested: int | None, context_length: int | None,
    *, default: int | None, fallback: int,
) -> int:
    """The max_new_tokens to run with. `default` is what an omitted value means (None: up to
    the context); `fallback` replaces an omitted value when `context_length` is unknown.
    Raises ClientError (400) when the prompt, or the prompt plus `requested`, exceeds the
    context. A negative `requested` is returned as is (SamplingParams.validate rejects it)."""
    if context_length is None:
        return requested if requested is not None else (fallback if default is None else default)
    if prompt_tokens >= context_length:
        raise ClientError(f"The input ({prompt_tokens} tokens) is longer than the model's "
                          f"context length ({context_length} tokens) allows: at most "
                          f"{context_length - 1} input tokens leave room for an output token.")
    room = context_length - prompt_tokens
    if requested is None:
        return room if default is None else min(default, room)
    if prompt_tokens + requested > context_length:
        raise ClientError(
            f"Requested token count exceeds the model's maximum context length of "
            f"{context_length} tokens. You requested a total of {prompt_tokens + requested} "
            f"tokens: {prompt_tokens} tokens from the input messages and {requested} tokens "
            f"for the completion. Please reduce the number of tokens in the input messages or "
            f"the completion to fit within the limit.")
    return requested
