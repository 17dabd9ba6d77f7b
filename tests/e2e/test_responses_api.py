"""`/v1/responses` as the OpenAI Python SDK reads it, with scripted harmony output: items,
tools, the second turn with a function_call_output, the stream helpers, the refused stateful
fields, the retrieval 404, and smg (1.13, PD mode) in front of a prefill and a decode server.

The backend is a `FakeHarmonyBackend` (a random-weight model cannot be made to emit harmony);
the tokenizer, its chat template, the API server, the SDK and the gateway are real. The live
tiny model behind smg is `test_responses_live.py`.
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
from tests.fakes.fake_harmony import SCRIPTS, FakeHarmonyBackend, harmony_pd_behind_smg

openai = pytest.importorskip("openai")
HAS_ROUTER = has_router()
TOOL = {"type": "function", "name": "get_weather", "description": "The weather in a city now",
        "parameters": {"type": "object", "required": ["city"], "properties": {
            "city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "f"]}}}}
TIME = {"type": "function", "name": "get_time",
        "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}}}
WEATHER = {"city": "Paris", "unit": "celsius"}
REASONING = "The user asks about the weather; call the tool."


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("responses") / "tiny-gpt-oss", seed=0)


@pytest.fixture(scope="module")
def served(model_dir: Path) -> Iterator[tuple[Any, FakeHarmonyBackend]]:
    backend = FakeHarmonyBackend(model_dir=model_dir, chunk_tokens=3)
    with ServerThread(ApiApp(backend, ApiConfig(served_model_name="gpt-oss"))) as server:
        yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0), backend


def _create(client: Any, script: str, **kw: Any) -> Any:
    return client.responses.create(model="gpt-oss", instructions="Be brief.",
                                   input=f"Weather in Paris? script:{script}", **kw)


def test_plain_answer_has_reasoning_then_message(served: tuple[Any, FakeHarmonyBackend]) -> None:
    client, backend = served
    resp = _create(client, "final", metadata={"k": "v"}, user="u1", store=True,
                   reasoning={"effort": "high"})
    assert resp.status == "completed" and resp.incomplete_details is None
    assert [o.type for o in resp.output] == ["reasoning", "message"]
    assert resp.output[0].content[0].text == REASONING
    assert resp.output_text == "It is sunny in Paris, 22 °C."
    assert resp.store is False and resp.metadata == {"k": "v"} and resp.user == "u1"
    ids = backend.tokenizer.encode(SCRIPTS["final"])
    assert resp.usage.output_tokens == len(ids)
    assert resp.usage.output_tokens_details.reasoning_tokens == len(
        backend.tokenizer.encode(REASONING))
    assert resp.usage.input_tokens_details.cached_tokens == 0  # the fake caches nothing
    prompt = backend.prompts[-1]
    assert "Reasoning: high" in prompt and "# Instructions\n\nBe brief." in prompt


def test_function_call_then_its_output_in_the_next_turn(
        served: tuple[Any, FakeHarmonyBackend]) -> None:
    client, backend = served
    first = _create(client, "call", tools=[TOOL])
    kinds = [o.type for o in first.output]
    call = first.output[-1]
    assert kinds == ["reasoning", "function_call"]
    assert call.type == "function_call" and call.status == "completed"
    assert call.name == "get_weather" and json.loads(call.arguments) == WEATHER
    history = [{"role": "user", "content": "Weather in Paris? script:answer"},
               *[o.model_dump(exclude_none=True) for o in first.output],
               {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 22 C"}]
    second = client.responses.create(model="gpt-oss", input=history, tools=[TOOL])
    assert second.output_text == "Sunny, 22 °C."
    prompt = backend.prompts[-1]
    assert f"<|channel|>analysis<|message|>{REASONING}<|end|>" in prompt
    assert ("<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
            f"<|message|>{call.arguments}<|call|>") in prompt
    assert ("<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"
            "sunny, 22 C<|end|>") in prompt


def test_stream_helper_events_and_final_response(served: tuple[Any, FakeHarmonyBackend]) -> None:
    client, _ = served
    with client.responses.stream(model="gpt-oss", input="script:call", tools=[TOOL]) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    args = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert reasoning == REASONING and len(args) > 1 and json.loads("".join(args)) == WEATHER
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert json.loads(done.arguments) == WEATHER
    assert final.output[-1].arguments == done.arguments and final.status == "completed"
    with client.responses.stream(model="gpt-oss", input="script:final") as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        assert text == stream.get_final_response().output_text == "It is sunny in Paris, 22 °C."


def test_cut_answer_is_incomplete(served: tuple[Any, FakeHarmonyBackend]) -> None:
    client, backend = served
    cut = len(backend.tokenizer.encode(SCRIPTS["call"])) - 5  # inside the arguments
    resp = _create(client, "call", tools=[TOOL], max_output_tokens=cut)
    assert resp.status == "incomplete"
    assert resp.incomplete_details.reason == "max_output_tokens"
    assert resp.output[-1].type == "function_call" and resp.output[-1].status == "incomplete"
    events = list(_create(client, "final", max_output_tokens=20, stream=True))
    assert events[-1].type == "response.incomplete" and events[-1].response.status == "incomplete"


def test_tool_choice_required_named_none_and_text_format(
        served: tuple[Any, FakeHarmonyBackend]) -> None:
    client, backend = served
    _create(client, "call", tools=[TOOL, TIME], tool_choice="required")
    grammar = backend.inputs[-1].sampling.grammar
    assert grammar is not None and grammar.kind == "structural_tag"
    assert "get_weather" in grammar.source and "get_time" in grammar.source
    _create(client, "call", tools=[TOOL, TIME], tool_choice={"type": "function",
                                                             "name": "get_time"})
    named = backend.inputs[-1].sampling.grammar
    assert named is not None and "get_time" in named.source and "get_weather" not in named.source
    _create(client, "final", tools=[TOOL], tool_choice="none")
    assert backend.inputs[-1].sampling.grammar is None and "get_weather" not in backend.prompts[-1]
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    _create(client, "final", text={"format": {"type": "json_schema", "name": "x",
                                              "schema": schema}})
    fmt = backend.inputs[-1].sampling.grammar
    assert fmt is not None and fmt.kind == "json_schema" and json.loads(fmt.source) == schema
    _create(client, "final", text={"format": {"type": "json_object"}}, temperature=0.5,
            top_p=0.9)
    sp = backend.inputs[-1].sampling
    assert sp.grammar is not None and sp.grammar.kind == "json_object"
    assert (sp.temperature, sp.top_p) == (0.5, 0.9)


@pytest.mark.parametrize("kw, words", [
    ({"previous_response_id": "resp_1"}, "previous_response_id is not supported"),
    ({"background": True}, "background=true is not supported"),
    ({"conversation": "conv_1"}, "conversation is not supported"),
    ({"tools": [{"type": "web_search_preview"}]}, "tool type 'web_search_preview'"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "name": "nope"}}, "not in `tools`"),
    ({"tools": [TOOL], "tool_choice": "required", "text": {"format": {"type": "json_object"}}},
     "at most one output constraint"),
    ({"reasoning": {"effort": "extreme"}}, "reasoning.effort='extreme'"),
])
def test_refused_fields_are_bad_requests_naming_why(served: tuple[Any, FakeHarmonyBackend],
                                                     kw: dict[str, Any], words: str) -> None:
    client, _ = served
    with pytest.raises(openai.BadRequestError) as err:
        _create(client, "final", **kw)
    assert words in err.value.message


def test_stored_responses_are_not_found_naming_why(
        served: tuple[Any, FakeHarmonyBackend]) -> None:
    client, _ = served
    for call in (lambda: client.responses.retrieve("resp_1"),
                 lambda: client.responses.delete("resp_1"),
                 lambda: client.responses.cancel("resp_1")):
        with pytest.raises(openai.NotFoundError) as err:
            call()
        assert "this server keeps no responses" in err.value.message


# -- through the router ----------------------------------------------------------------------

@pytest.mark.router
@pytest.mark.slow
@pytest.mark.skipif(not HAS_ROUTER, reason="smg is not installed")
def test_through_smg_both_servers_get_the_body_and_render_alike(model_dir: Path) -> None:
    with harmony_pd_behind_smg(model_dir) as (client, pre, dec):
        call = _create(client, "call", tools=[TOOL], tool_choice="required").output[-1]
        assert json.loads(call.arguments) == WEATHER
        with client.responses.stream(model="gpt-oss", input="script:final") as stream:
            final = stream.get_final_response()
        assert final.output_text == "It is sunny in Paris, 22 °C."
        with pytest.raises(openai.BadRequestError) as err:
            _create(client, "final", previous_response_id="resp_1")
        assert "keeps no responses" in err.value.message
    assert pre.prompts[-2:] == dec.prompts[-2:] and pre.inputs and dec.inputs
    rooms = {(i.bootstrap_host, i.bootstrap_port, i.bootstrap_room) for i in dec.inputs}
    assert all(room is not None for _, _, room in rooms)
    assert rooms == {(i.bootstrap_host, i.bootstrap_port, i.bootstrap_room) for i in pre.inputs}


def test_plain_text_model_and_an_error_mid_stream() -> None:
    """A tokenizer without harmony tokens: the text is one message, tools are a 400; an error
    after the stream started ends it with response.failed (the run is closed)."""
    from tests.fakes.fake_backend import FakeBackend

    backend = FakeBackend(reply=b"Hello, world!", chunk_tokens=4, eos_at_end=True,
                          cached_tokens=3)
    with ServerThread(ApiApp(backend, ApiConfig(served_model_name="m"))) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        resp = client.responses.create(model="m", input="hi")
        assert resp.status == "completed" and resp.output_text == "Hello, world!"
        assert [o.type for o in resp.output] == ["message"]
        assert resp.usage.input_tokens_details.cached_tokens == 3
        assert resp.usage.output_tokens_details.reasoning_tokens == 0
        with pytest.raises(openai.BadRequestError, match="tool calls are not parsed"):
            client.responses.create(model="m", input="hi", tools=[TOOL])
        backend.error_after = 5
        events = list(client.responses.create(model="m", input="hi", stream=True))
    assert events[-1].type == "response.failed"
    assert events[-1].response.status == "failed" and events[-1].response.error.message
    assert backend.closed
