"""Request bodies (msgspec): SGLang `/generate` and the OpenAI completions/chat shapes.

Unknown fields are accepted and ignored (the router adds many). Type errors surface as
`msgspec.ValidationError`, which the app answers 400 with msgspec's message (it names the field).
"""

from __future__ import annotations

from typing import Any, Protocol, TypeVar

import msgspec

from decode_worker.core.sampling import GrammarSpec, SamplingParams, pick_grammar
from decode_worker.errors import ClientError
from decode_worker.io.api import structured

T = TypeVar("T")


class Penalties(Protocol):
    """Sampling controls clients send that this server does not apply yet (fields of both
    `SamplingIn` and `OpenAIBase`): parsed so that a value that would change the output is a
    400 (`refuse_unapplied`), never a silent ignore; their neutral values (what SDKs send by
    default) pass."""

    frequency_penalty: float | None
    presence_penalty: float | None
    repetition_penalty: float | None
    logit_bias: dict[str, float] | None


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
    json_schema: str | dict[str, Any] | None = None  # structured output (structured.py)
    regex: str | None = None
    ebnf: str | None = None
    frequency_penalty: float | None = None  # not applied: 400 unless neutral (Penalties)
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    min_new_tokens: int | None = None


class Bootstrap(msgspec.Struct):
    """The router's P/D fields, shared by every generation body: scalars for one sample, arrays
    with one entry per sample for `n > 1` or an array prompt (see `targets.py`). Also SGLang's
    extra outputs, which the gateway (smg) sends as `false` on every `/generate`: this server
    does not produce them, so `true` is a 400 (`refuse_extra_outputs`), never a silent ignore."""

    bootstrap_host: str | list[str] | None = None
    bootstrap_port: int | list[int] | None = None
    bootstrap_room: int | list[int] | None = None
    return_hidden_states: bool = False
    return_entropy: bool = False
    return_bytes: bool = False


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
    response_format: structured.ResponseFormat | None = None  # structured output (structured.py)
    tools: list[Any] | None = None  # chat with a tool-call parser (harmony/tools.py), else 400
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    frequency_penalty: float | None = None  # not applied: 400 unless neutral (Penalties)
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    min_tokens: int | None = None  # SGLang's and vLLM's extension
    return_cached_tokens_details: bool = False  # SGLang's: `sglext.cached_tokens_details`


class CompletionReq(OpenAIBase):
    prompt: str | list[Any] | None = None
    logprobs: int | None = None
    echo: bool = False


class ContentPart(msgspec.Struct):
    type: str = "text"
    text: str | None = None


class Message(msgspec.Struct):
    """A chat message; tool calls, a tool's result and reasoning go to the chat template."""

    role: str
    content: str | list[ContentPart] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    name: str | None = None
    reasoning_content: str | None = None


class ChatReq(OpenAIBase):
    messages: list[Message] = msgspec.field(default_factory=list)
    logprobs: bool = False
    top_logprobs: int | None = None
    separate_reasoning: bool = True  # SGLang's: the analysis in message.reasoning_content
    parallel_tool_calls: bool | None = None  # accepted; a harmony turn ends at its first call


def decode_body(body: bytes, kind: type[T]) -> T:
    """Parse a JSON body. Raises ClientError (400) naming what is wrong."""
    if not body.strip():
        raise ClientError("request body is empty; expected a JSON object")
    try:
        req = msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        raise ClientError(f"invalid request: {exc}") from None
    except msgspec.DecodeError as exc:
        raise ClientError(f"malformed JSON: {exc}") from None
    if isinstance(req, Bootstrap):
        refuse_extra_outputs(req)
    return req


def refuse_extra_outputs(req: Bootstrap) -> None:
    """Raises ClientError (400) when a body asks for an output this server does not produce."""
    for name in ("return_hidden_states", "return_entropy", "return_bytes"):
        if getattr(req, name):
            raise ClientError(f"{name}=true is not supported by this server (it would be "
                              f"ignored); leave it out or send false")


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
    grammar: GrammarSpec | None = None,
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
        grammar=grammar,
    )
    params.validate()
    return params


def refuse_unapplied(p: Penalties, min_tokens: int | None) -> None:
    """Raises ClientError (400) naming the first control set to a value this server would
    ignore: penalties other than 0 (repetition: 1), a logit bias, a minimum length."""
    asked: list[tuple[str, object]] = [(name, value) for name, value, neutral in (
        ("frequency_penalty", p.frequency_penalty, 0.0),
        ("presence_penalty", p.presence_penalty, 0.0),
        ("repetition_penalty", p.repetition_penalty, 1.0),
        ("min_tokens", min_tokens, 0),
    ) if value is not None and value != neutral]
    if p.logit_bias:
        asked.append(("logit_bias", p.logit_bias))
    if asked:
        name, value = asked[0]
        raise ClientError(f"{name}={str(value)[:80]} is not supported by this server (it "
                          f"would be ignored); leave it out or send its neutral value")


def sampling_from_generate(sp: SamplingIn, max_new_tokens: int) -> SamplingParams:
    """`max_new_tokens` is the resolved limit (`limits.resolve_max_new_tokens`). Raises
    ClientError (400), also for a control this server does not apply (`refuse_unapplied`)."""
    refuse_unapplied(sp, sp.min_new_tokens)
    return build_sampling(
        max_new_tokens=max_new_tokens,
        temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k, min_p=sp.min_p,
        seed=sp.seed if sp.seed is not None else sp.sampling_seed, stop=sp.stop,
        stop_token_ids=sp.stop_token_ids, ignore_eos=sp.ignore_eos, no_stop_trim=sp.no_stop_trim,
        skip_special_tokens=sp.skip_special_tokens,
        grammar=structured.grammar_from_sampling(sp.json_schema, sp.regex, sp.ebnf),
    )


def requested_max_tokens(req: OpenAIBase) -> int | None:
    """`max_completion_tokens` wins over `max_tokens` (the router renames the latter)."""
    return req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens


def sampling_from_openai(req: OpenAIBase, max_new_tokens: int, *, tools_parsed: bool = False,
                         tool_grammar: GrammarSpec | None = None) -> SamplingParams:
    """`max_new_tokens` is the resolved limit (`limits.resolve_max_new_tokens`). Raises
    ClientError (400), also for a request that asks for tool calls unless they are parsed
    (`tools_parsed`: chat with a tool-call parser; `tool_grammar` forces a call)."""
    if tools_parsed:
        structured.refuse_tools(None, None, req.functions, req.function_call)
    else:
        structured.refuse_tools(req.tools, req.tool_choice, req.functions, req.function_call)
    refuse_unapplied(req, req.min_tokens)
    grammar = structured.grammar_from_response_format(req.response_format)
    if tool_grammar is not None:
        grammar = pick_grammar({"response_format": grammar, "tool_choice": tool_grammar})
    return build_sampling(
        max_new_tokens=max_new_tokens,
        temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
        seed=req.seed, stop=req.stop, stop_token_ids=req.stop_token_ids,
        ignore_eos=req.ignore_eos, no_stop_trim=req.no_stop_trim,
        skip_special_tokens=req.skip_special_tokens, grammar=grammar,
    )
