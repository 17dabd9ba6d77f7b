"""The OpenAI Python SDK as a client (issue 16): against the live decode worker (alone, and with
the reference prefill peer as P/D) and through the SGLang Model Gateway in PD mode in front of
both.

`api` is parametrized: "decode" is the decode worker on its own (it prefills itself), "router"
is `smg.launch_router --pd-disaggregation` (smg 1.13) in front of the prefill peer and the decode
worker. The router loads the tokenizer from the model directory the workers report (local), so
nothing leaves the machine. Every client has `max_retries=0`: an error is seen, never retried.
"""

from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from decode_worker.daemon.shared.router import has_router
from tests.e2e.driver import Workers

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytestmark = pytest.mark.slow
HAS_ROUTER = has_router()
APIS = ["decode", pytest.param("router", marks=[pytest.mark.router, pytest.mark.skipif(
    not HAS_ROUTER, reason="smg is not installed (pip install -e '.[router]')")])]
GREEDY: dict[str, Any] = {"temperature": 0, "extra_body": {"ignore_eos": True}}
MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Name three colours."}]
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}}}
CITY = {"type": "object", "additionalProperties": False, "required": ["city"],
        "properties": {"city": {"type": "string", "maxLength": 8}}}
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def stack(plain_routed: Workers) -> Workers:
    """Prefill peer + decode worker (+ the router when smg is installed), shared (conftest)."""
    return plain_routed


def _client(url: str) -> Any:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120, max_retries=0)


@pytest.fixture(params=APIS)
def api(request: pytest.FixtureRequest, stack: Workers) -> Any:
    if request.param == "router":
        assert stack.router is not None
        return _client(stack.router.url)
    return _client(stack.decode.url)


@pytest.fixture(scope="module")
def model(stack: Workers) -> str:
    ids = [m.id for m in _client(stack.decode.url).models.list().data]
    assert len(ids) == 1, ids
    return str(ids[0])


def _chat(api: Any, model: str, **kw: Any) -> Any:
    args: dict[str, Any] = {"model": model, "messages": MESSAGES, "max_tokens": 6, **GREEDY}
    return api.chat.completions.create(**{**args, **kw})


def _text_of(chunks: list[Any]) -> dict[int, str]:
    out: dict[int, str] = {}
    for chunk in chunks:
        for ch in chunk.choices:
            piece = ch.delta.content if hasattr(ch, "delta") else ch.text
            out[ch.index] = out.get(ch.index, "") + (piece or "")
    return out


@pytest.mark.router
@pytest.mark.skipif(not HAS_ROUTER, reason="smg is not installed")
def test_models_through_router_lists_exactly_one_model(stack: Workers, model: str) -> None:
    assert stack.router is not None
    listed = _client(stack.router.url).models.list().data
    assert [m.id for m in listed] == [model]


def test_chat_and_completions(api: Any, model: str, stack: Workers) -> None:
    chat = _chat(api, model)
    assert len(chat.choices) == 1 and chat.choices[0].finish_reason == "length"
    assert isinstance(chat.choices[0].message.content, str)
    assert chat.usage.completion_tokens == 6 and chat.usage.prompt_tokens > 0
    # greedy: the decode worker alone gives the same text
    assert chat.choices[0].message.content == _chat(_client(stack.decode.url), model).choices[
        0].message.content
    comp = api.completions.create(model=model, prompt="The sky is", max_tokens=5, **GREEDY)
    assert comp.choices[0].finish_reason == "length" and comp.usage.completion_tokens == 5


def test_chat_pd_without_router_matches_decode_alone(stack: Workers, model: str) -> None:
    """The router's part played by hand: the same body, bootstrap fields included, to both."""
    boot = {"bootstrap_host": "127.0.0.1", "bootstrap_port": stack.boot_port,
            "bootstrap_room": random.getrandbits(63), "ignore_eos": True}
    kw: dict[str, Any] = {"temperature": 0, "extra_body": boot}
    with ThreadPoolExecutor(1) as pool:
        pre = pool.submit(_chat, _client(stack.prefill.url), model, **kw)
        dec = _chat(_client(stack.decode.url), model, **kw)
        assert pre.result().usage.completion_tokens == 1  # the prefill peer: first token only
    assert dec.usage.completion_tokens == 6
    alone = _chat(_client(stack.decode.url), model)
    assert dec.choices[0].message.content == alone.choices[0].message.content


@pytest.mark.parametrize("kind", ["chat", "completions"])
def test_streaming_with_usage_matches_non_streaming(api: Any, model: str, kind: str) -> None:
    if kind == "chat":
        full = _chat(api, model).choices[0].message.content
        chunks = list(_chat(api, model, stream=True, stream_options={"include_usage": True}))
    else:
        args: dict[str, Any] = {"model": model, "prompt": "Once upon", "max_tokens": 6, **GREEDY}
        full = api.completions.create(**args).choices[0].text
        chunks = list(api.completions.create(**args, stream=True,
                                             stream_options={"include_usage": True}))
    assert _text_of(chunks) == {0: full}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_errors_parse_as_api_status_error(api: Any, model: str) -> None:
    with pytest.raises(openai.APIStatusError) as err:
        _chat(api, model, max_tokens=10_000_000)  # past the context length
    assert err.value.status_code == 400
    assert "context" in err.value.message.lower() or "length" in err.value.message.lower()
    with pytest.raises(openai.BadRequestError):
        api.completions.create(model=model, prompt="x", max_tokens=4, temperature=-1.0)


# -- n > 1, prompt batches, json_schema and tools (the lead's and another engineer's parts) --

@pytest.mark.parametrize("stream", [False, True])
def test_n2_chat_and_completions(api: Any, model: str, stream: bool) -> None:
    sampled: dict[str, Any] = {"n": 2, "temperature": 1.0, "seed": 7, "max_tokens": 5,
                               "extra_body": {"ignore_eos": True}, "stream": stream}
    chat = _chat(api, model, **sampled)
    comp = api.completions.create(model=model, prompt="Count: one, two,", **sampled)
    for reply in (chat, comp):
        if stream:
            texts = _text_of(list(reply))
            assert sorted(texts) == [0, 1], texts
        else:
            assert sorted(c.index for c in reply.choices) == [0, 1]
            assert all(c.finish_reason == "length" for c in reply.choices)
            assert reply.usage.completion_tokens == 10


def test_batch_of_prompts_matches_one_by_one(api: Any, model: str) -> None:
    prompts = ["The sky is", "Two plus two", "Hello, my name"]
    args: dict[str, Any] = {"model": model, "max_tokens": 4, **GREEDY}
    batch = api.completions.create(prompt=prompts, **args)
    assert sorted(c.index for c in batch.choices) == [0, 1, 2]
    one_by_one = [api.completions.create(prompt=p, **args).choices[0].text for p in prompts]
    assert [c.text for c in sorted(batch.choices, key=lambda c: c.index)] == one_by_one
    assert batch.usage.completion_tokens == 12


def test_json_schema_output_parses_and_validates(api: Any, model: str) -> None:
    rng = random.Random(16)
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                   "strict": True}}
    for i in range(20):
        who = "".join(rng.choice("abcdefghijklmnop") for _ in range(rng.randrange(3, 9)))
        reply = _chat(api, model, messages=[{"role": "user", "content": f"Describe {who}."}],
                      response_format=fmt, max_tokens=64, temperature=1.0, seed=i,
                      extra_body={})
        text = reply.choices[0].message.content
        assert reply.choices[0].finish_reason == "stop", (i, text)
        jsonschema.validate(json.loads(text), PERSON)


def test_forced_tool_call_on_the_live_model_is_a_valid_call(api: Any, model: str) -> None:
    """The tiny model speaks harmony's tokens but not the format (random weights); a named
    tool_choice is a grammar, so its output is a call whose arguments match the schema, on the
    decode worker alone and through the router (the prefill peer samples the first token under
    the same grammar). With tool_choice auto the tools are accepted too (issue 24)."""
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": CITY}}
    forced = {"type": "function", "function": {"name": "get_weather"}}
    for seed in range(3):
        reply = _chat(api, model, tools=[tool], tool_choice=forced, max_tokens=128,
                      temperature=1.0, seed=seed, extra_body={})
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        [call] = choice.message.tool_calls
        assert call.function.name == "get_weather" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), CITY)
    auto = _chat(api, model, tools=[TOOL], max_tokens=8)
    assert auto.choices[0].finish_reason in ("length", "stop", "tool_calls")


def test_other_model_name_is_not_found(stack: Workers, model: str) -> None:
    api = _client(stack.decode.url)
    assert _chat(api, model).model == model
    with pytest.raises(openai.NotFoundError) as err:
        _chat(api, model + "-other")
    assert err.value.status_code == 404 and model + "-other" in err.value.message
