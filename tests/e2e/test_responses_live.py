"""`/v1/responses` on the live tiny model: the OpenAI Python SDK and the OpenAI Agents SDK
through smg 1.13 in PD mode in front of the reference prefill peer and the decode worker.

A forced `tool_choice` is a grammar, so its call's arguments match the tool's schema even
with random weights. The Agents SDK runs an agent with one function tool and `tool_choice`
"required" for at least one tool round trip; the decode-side prefix reuse of its later turns
(`usage.input_tokens_details.cached_tokens` / `input_tokens`) is printed.
"""

from __future__ import annotations

import asyncio
import json
from typing import Annotated, Any

import pytest
from pydantic import Field

from decode_worker.daemon.shared.router import has_router
from tests.e2e.driver import Workers

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytestmark = [pytest.mark.slow, pytest.mark.router,
              pytest.mark.skipif(not has_router(), reason="smg is not installed")]
CITY = {"type": "object", "additionalProperties": False, "required": ["city"],
        "properties": {"city": {"type": "string", "maxLength": 8}}}
TOOL = {"type": "function", "name": "get_weather", "parameters": CITY}
TIME = {"type": "function", "name": "get_time", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["tz"],
    "properties": {"tz": {"type": "string", "maxLength": 6}}}}
GREEDY: dict[str, Any] = {"temperature": 0, "max_output_tokens": 128}


@pytest.fixture(scope="module")
def stack(plain_routed: Workers) -> Workers:
    """Prefill peer + decode worker behind smg, shared (conftest)."""
    return plain_routed


@pytest.fixture(scope="module")
def client(stack: Workers) -> Any:
    assert stack.router is not None
    return openai.OpenAI(base_url=f"{stack.router.url}/v1", api_key="x", timeout=120,
                         max_retries=0)


@pytest.fixture(scope="module")
def model(client: Any) -> str:
    return str(client.models.list().data[0].id)


def _valid_call(resp: Any, tool: dict[str, Any]) -> Any:
    call = resp.output[-1]
    assert resp.status == "completed" and call.type == "function_call", resp
    assert call.name == tool["name"] and call.call_id
    jsonschema.validate(json.loads(call.arguments), tool["parameters"])
    return call


def test_plain_create(client: Any, model: str) -> None:
    resp = client.responses.create(model=model, input="Name three colours.", temperature=0,
                                   max_output_tokens=8, instructions="Be terse.", store=True)
    assert resp.status in ("completed", "incomplete")
    assert resp.store is False  # served without storing, and the answer says so
    assert 0 < resp.usage.output_tokens <= 8 and resp.usage.input_tokens > 10
    assert resp.usage.total_tokens == resp.usage.input_tokens + resp.usage.output_tokens


def test_forced_calls_then_a_second_turn_reuses_the_prefix(client: Any, model: str) -> None:
    required = client.responses.create(model=model, input="Weather in Paris?", tools=[TOOL],
                                       tool_choice="required", **GREEDY)
    call = _valid_call(required, TOOL)
    named = client.responses.create(model=model, input="Time in Paris?", tools=[TOOL, TIME],
                                    tool_choice={"type": "function", "name": "get_time"},
                                    **GREEDY)
    _valid_call(named, TIME)
    history = [{"role": "user", "content": "Weather in Paris?"},
               *[o.model_dump(exclude_none=True) for o in required.output],
               {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}]
    second = client.responses.create(model=model, input=history, tools=[TOOL], temperature=0,
                                     max_output_tokens=8)
    assert second.status in ("completed", "incomplete")
    cached = second.usage.input_tokens_details.cached_tokens
    assert 0 < cached < second.usage.input_tokens  # the first turn's prompt, from the decode tree


def test_stream_helper_text_and_arguments(client: Any, model: str) -> None:
    with client.responses.stream(model=model, input="Weather in Paris?", tools=[TOOL],
                                 tool_choice="required", **GREEDY) as stream:
        events = list(stream)
        final = stream.get_final_response()
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert args and args == _valid_call(final, TOOL).arguments
    assert [e.sequence_number for e in events] == list(range(len(events)))
    with client.responses.stream(model=model, input="Say hi.", temperature=0,
                                 max_output_tokens=12) as stream:
        kinds = [(e.type, getattr(e, "delta", "")) for e in stream]
        final = stream.get_final_response() if kinds[-1][0] == "response.completed" else None
    text = "".join(d for k, d in kinds if k == "response.output_text.delta")
    assert kinds[-1][0] in ("response.completed", "response.incomplete")
    if final is not None:
        assert text == final.output_text


def test_refused_fields_through_the_gateway(client: Any, model: str, stack: Workers) -> None:
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        client.responses.create(model=model, input="hi", previous_response_id="resp_1")
    with pytest.raises(openai.BadRequestError, match="'web_search_preview'"):
        client.responses.create(model=model, input="hi", tools=[{"type": "web_search_preview"}])
    # smg's typed body has no `background` (it drops the field): the worker refuses it itself
    direct = openai.OpenAI(base_url=f"{stack.decode.url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="background=true"):
        direct.responses.create(model=model, input="hi", background=True)
    with pytest.raises(openai.NotFoundError, match="keeps no responses"):
        direct.responses.retrieve("resp_1")


def test_agents_sdk_tool_round_trip(stack: Workers, model: str) -> None:
    agents = pytest.importorskip("agents")
    assert stack.router is not None
    calls: list[str] = []

    @agents.function_tool
    def get_weather(city: Annotated[str, Field(max_length=8)]) -> str:
        """The weather in a city now."""
        calls.append(city)
        return "sunny, 22 C"

    agents.set_tracing_disabled(True)
    async_client = openai.AsyncOpenAI(base_url=f"{stack.router.url}/v1", api_key="x",
                                      timeout=120, max_retries=0)
    agent = agents.Agent(
        name="weather", instructions="Answer with the weather tool.", tools=[get_weather],
        model=agents.OpenAIResponsesModel(model=model, openai_client=async_client),
        model_settings=agents.ModelSettings(tool_choice="required", temperature=0,
                                            max_tokens=128),
        reset_tool_choice=False)  # every turn a forced (so whole) call: random weights

    async def run() -> list[Any]:
        try:
            result = await agents.Runner.run(agent, "Weather in Paris?", max_turns=3)
            return list(result.raw_responses)
        except agents.MaxTurnsExceeded as exc:
            assert exc.run_data is not None
            return list(exc.run_data.raw_responses)
        finally:
            await async_client.close()  # in this loop: a socket left open fails a later test

    turns = asyncio.run(run())
    assert calls and len(turns) >= 2  # a call, its result in the next turn's input
    later = turns[1:]
    hit = sum(t.usage.input_tokens_details.cached_tokens for t in later) / sum(
        t.usage.input_tokens for t in later)
    print(f"agents sdk: {len(turns)} turns, {len(calls)} tool calls, decode-side hit rate of "
          f"later turns {hit:.3f}")
    assert hit > 0
