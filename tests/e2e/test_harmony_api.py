"""gpt-oss's harmony output through the real HTTP server, as the OpenAI Python SDK reads it:
reasoning_content, content, tool_calls (plain and streamed, with the SDK's stream helper), the
tool result of the next turn rendered by the chat template, tool_choice, and the SGLang Model
Gateway (smg, PD mode) in front of a prefill and a decode server.

The backend is a `FakeHarmonyBackend` (tests/fakes/fake_harmony.py): the model output is a
given harmony token sequence, because a random-weight model cannot be made to emit harmony.
Everything else is real: the tiny model's tokenizer and chat template, the API server, the SDK.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from decode_worker.daemon.shared.router import has_router
from decode_worker.device.default_model import write_model
from decode_worker.io.api import ApiApp, ApiConfig
from tests.fakes.fake_backend import ServerThread
from tests.fakes.fake_harmony import (
    ANALYSIS,
    CALL,
    SCRIPTS,
    FakeHarmonyBackend,
    harmony_pd_behind_smg,
)

openai = pytest.importorskip("openai")
HAS_ROUTER = has_router()  # smg, the router of record (tests/e2e/driver.RouterProcess)
TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now",
    "parameters": {"type": "object", "required": ["city"], "properties": {
        "city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "f"]}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string"}}}}}
WEATHER = {"city": "Paris", "unit": "celsius"}


def ask(script: str) -> list[dict[str, Any]]:
    return [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": f"Weather in Paris? script:{script}"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("harmony") / "tiny-gpt-oss", seed=0)


@pytest.fixture(scope="module")
def served(model_dir: Path) -> Iterator[tuple[Any, FakeHarmonyBackend]]:
    backend = FakeHarmonyBackend(model_dir=model_dir, chunk_tokens=3)
    with ServerThread(ApiApp(backend, ApiConfig(served_model_name="gpt-oss"))) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        yield client, backend


def _create(client: Any, script: str, **kw: Any) -> Any:
    return client.chat.completions.create(model="gpt-oss", messages=ask(script), **kw)


def test_reasoning_and_final_answer(served: tuple[Any, FakeHarmonyBackend]) -> None:
    client, _ = served
    choice = _create(client, "final").choices[0]
    assert choice.finish_reason == "stop" and choice.message.tool_calls is None
    assert choice.message.content == "It is sunny in Paris, 22 °C."
    assert choice.message.reasoning_content.startswith("The user asks about the weather")


def test_tool_call_with_tools_rendered_by_the_template(
        served: tuple[Any, FakeHarmonyBackend]) -> None:
    client, backend = served
    reply = _create(client, "call", tools=[TOOL])
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == WEATHER
    assert "type get_weather = (_: " in backend.prompts[-1]  # the tools, in the developer message
    assert reply.usage.completion_tokens == len(backend.tokenizer.encode(SCRIPTS["call"]))


def test_two_tool_calls_in_one_turn(served: tuple[Any, FakeHarmonyBackend]) -> None:
    client, _ = served
    calls = _create(client, "two", tools=[TOOL, TIME]).choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["get_weather", "get_time"]
    assert len({c.id for c in calls}) == 2


def test_tool_result_of_the_next_turn_goes_through_the_template(
        served: tuple[Any, FakeHarmonyBackend]) -> None:
    client, backend = served
    first = _create(client, "call", tools=[TOOL]).choices[0].message
    call = first.tool_calls[0]
    messages = [*ask("answer"), first.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": "sunny, 22 C"}]
    reply = client.chat.completions.create(model="gpt-oss", messages=messages, tools=[TOOL])
    assert reply.choices[0].message.content == "Sunny, 22 °C."
    prompt = backend.prompts[-1]
    assert ("<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
            f"<|message|>{call.function.arguments}<|call|>") in prompt
    assert ("<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"
            "sunny, 22 C<|end|>") in prompt
    assert prompt.endswith("<|start|>assistant")


def test_stream_helper_assembles_the_tool_call(served: tuple[Any, FakeHarmonyBackend]) -> None:
    client, _ = served
    with client.chat.completions.stream(model="gpt-oss", messages=ask("call"),
                                        tools=[TOOL]) as stream:
        events = list(stream)
        final = stream.get_final_completion()
    pieces = [e.arguments_delta for e in events if e.type == "tool_calls.function.arguments.delta"]
    assert len(pieces) > 1 and "".join(pieces) == json.dumps(WEATHER)
    done = [e for e in events if e.type == "tool_calls.function.arguments.done"]
    assert [(e.name, json.loads(e.arguments)) for e in done] == [("get_weather", WEATHER)]
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert json.loads(choice.message.tool_calls[0].function.arguments) == WEATHER


def test_stream_deltas_equal_the_plain_answer(served: tuple[Any, FakeHarmonyBackend]) -> None:
    client, _ = served
    plain = _create(client, "final").choices[0]
    chunks = list(_create(client, "final", stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas)
    assert reasoning == plain.message.reasoning_content
    assert "".join(d.content or "" for d in deltas) == plain.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    first_content = next(i for i, d in enumerate(deltas) if d.content)
    assert all(not (d.model_extra or {}).get("reasoning_content")
               for d in deltas[first_content:])  # reasoning first, then the answer


def _streamed_message(chunks: list[Any]) -> tuple[str, dict[int, dict[str, str]], str]:
    """A stream's content, its tool calls by index (id, name, arguments) and finish reason."""
    content, calls, finish = "", {}, ""
    for c in chunks:
        if not c.choices:
            continue
        delta = c.choices[0].delta
        content += delta.content or ""
        for piece in delta.tool_calls or []:
            call = calls.setdefault(piece.index, {"id": "", "name": "", "arguments": ""})
            call["id"] += piece.id or ""
            call["name"] += (piece.function and piece.function.name) or ""
            call["arguments"] += (piece.function and piece.function.arguments) or ""
        finish = c.choices[0].finish_reason or finish
    return content, calls, finish


@pytest.mark.parametrize("cut_after", ['{"city": "Pa', "commentary to=functions.get_w"])
def test_a_call_cut_by_max_tokens_is_the_same_plain_and_streamed(
        served: tuple[Any, FakeHarmonyBackend], cut_after: str) -> None:
    """OpenAI's form for a call cut by max_tokens: `tool_calls` with the arguments so far and
    finish_reason "length", plain and streamed alike. Cut inside its header, it is no call."""
    client, backend = served
    script = ANALYSIS + CALL
    max_tokens = len(backend.tokenizer.encode(script[:script.index(cut_after) + len(cut_after)]))
    plain = _create(client, "call", tools=[TOOL], max_tokens=max_tokens).choices[0]
    content, calls, finish = _streamed_message(list(_create(
        client, "call", tools=[TOOL], max_tokens=max_tokens, stream=True)))
    assert plain.finish_reason == finish == "length"
    assert (plain.message.content or "") == content
    if cut_after.startswith("{"):  # cut inside the arguments
        [call] = plain.message.tool_calls
        assert call.id.startswith("call_") and calls[0]["id"].startswith("call_")
        assert (call.function.name, call.function.arguments) == ("get_weather", cut_after)
        assert [(c["name"], c["arguments"]) for c in calls.values()] == [
            ("get_weather", cut_after)]
        assert not content
    else:  # cut inside the header: its text is content, no call either way
        assert plain.message.tool_calls is None and calls == {}
        assert "get_w" in content


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings_cut_reasoning_and_content(served: tuple[Any, FakeHarmonyBackend],
                                                stream: bool) -> None:
    client, _ = served
    for stop, reasoning, content in (("Paris", "The user asks about the weather; call the "
                                      "tool.", "It is sunny in "),
                                     ("weather", "The user asks about the ", "")):
        reply = _create(client, "final", stop=[stop], stream=stream)
        if stream:
            deltas = [c.choices[0].delta for c in reply if c.choices]
            got_r = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas)
            got_c = "".join(d.content or "" for d in deltas)
        else:
            msg = reply.choices[0].message
            got_r, got_c = msg.model_extra.get("reasoning_content") or "", msg.content
            assert reply.choices[0].finish_reason == "stop"
        assert (got_r, got_c) == (reasoning, content)


def test_separate_reasoning_false_returns_the_raw_text(
        served: tuple[Any, FakeHarmonyBackend]) -> None:
    client, _ = served
    msg = _create(client, "final", extra_body={"separate_reasoning": False}).choices[0].message
    assert msg.model_extra.get("reasoning_content") is None
    assert msg.content == ("analysisThe user asks about the weather; call the tool."
                           "assistantfinalIt is sunny in Paris, 22 °C.")
    raw = _create(client, "final", extra_body={"separate_reasoning": False,
                                                "skip_special_tokens": False})
    assert raw.choices[0].message.content.startswith("<|channel|>analysis<|message|>")


def test_tool_choice_required_and_named_are_grammars(
        served: tuple[Any, FakeHarmonyBackend]) -> None:
    client, backend = served
    _create(client, "call", tools=[TOOL, TIME], tool_choice="required")
    grammar = backend.inputs[-1].sampling.grammar
    assert grammar is not None and grammar.kind == "structural_tag"
    assert "get_weather" in grammar.source and "get_time" in grammar.source
    _create(client, "call", tools=[TOOL, TIME],
            tool_choice={"type": "function", "function": {"name": "get_time"}})
    named = backend.inputs[-1].sampling.grammar
    assert named is not None and "get_time" in named.source and "get_weather" not in named.source
    _create(client, "final", tools=[TOOL], tool_choice="none")
    assert backend.inputs[-1].sampling.grammar is None
    assert "get_weather" not in backend.prompts[-1]  # "none": the tools are left out


@pytest.mark.parametrize("kw, words", [
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "not in `tools`"),
    ({"tools": [{"type": "code_interpreter"}]}, "only function tools"),
    ({"tools": [TOOL], "tool_choice": "required",
      "response_format": {"type": "json_object"}}, "at most one output constraint"),
    ({"tool_choice": "required"}, "needs `tools`"),
])
def test_bad_tool_requests_are_400s(served: tuple[Any, FakeHarmonyBackend], kw: dict[str, Any],
                                    words: str) -> None:
    client, _ = served
    with pytest.raises(openai.BadRequestError) as err:
        _create(client, "call", **kw)
    assert words in err.value.message


def test_parsers_off_give_raw_text_and_refuse_tools(model_dir: Path) -> None:
    backend = FakeHarmonyBackend(model_dir=model_dir)
    config = ApiConfig(served_model_name="gpt-oss", reasoning_parser="none",
                       tool_call_parser="none")
    with ServerThread(ApiApp(backend, config)) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        msg = _create(client, "final").choices[0].message
        assert msg.content.startswith("analysisThe user asks")
        with pytest.raises(openai.BadRequestError) as err:
            _create(client, "call", tools=[TOOL])
        assert "tool calls are not parsed" in err.value.message


# -- through the router ----------------------------------------------------------------------

@pytest.mark.router
@pytest.mark.slow
@pytest.mark.skipif(not HAS_ROUTER, reason="smg is not installed")
def test_through_the_router_plain_and_streamed(model_dir: Path) -> None:
    with harmony_pd_behind_smg(model_dir) as (client, pre, dec):
        choice = _create(client, "call", tools=[TOOL]).choices[0]
        assert choice.finish_reason == "tool_calls"
        assert json.loads(choice.message.tool_calls[0].function.arguments) == WEATHER
        assert choice.message.model_extra["reasoning_content"].startswith("The user asks")
        with client.chat.completions.stream(model="gpt-oss", messages=ask("final"),
                                            tools=[TOOL]) as stream:
            final = stream.get_final_completion()
        assert final.choices[0].message.content == "It is sunny in Paris, 22 °C."
    assert pre.inputs and dec.inputs  # both servers took the requests, with the tools
    assert pre.prompts[-1] == dec.prompts[-1] and "type get_weather" in dec.prompts[-1]
