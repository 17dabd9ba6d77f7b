"""Structured output and tool fields over HTTP (fake backend): what reaches the backend as the
request's `GrammarSpec`, and the 400s (two constraints, a malformed one, tools)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from decode_worker.core.sampling import GrammarSpec
from decode_worker.io.api import ApiApp, ApiConfig
from tests.fakes.fake_backend import FakeBackend, ServerThread

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.fixture
def backend() -> FakeBackend:
    return FakeBackend()


@pytest.fixture
def client(backend: FakeBackend) -> Iterator[httpx.Client]:
    app = ApiApp(backend, ApiConfig(served_model_name="tiny", default_max_new_tokens=5))
    with ServerThread(app) as srv, httpx.Client(base_url=srv.url, timeout=5) as c:
        yield c


def _chat(**kw: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, **kw}


@pytest.mark.parametrize(("path", "body", "want"), [
    ("/v1/chat/completions", _chat(response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}),
     GrammarSpec("json_schema", json.dumps(SCHEMA, sort_keys=True, separators=(",", ":")))),
    ("/v1/completions", {"prompt": "a", "response_format": {"type": "json_object"}},
     GrammarSpec("json_object")),
    ("/v1/chat/completions", _chat(response_format={"type": "text"}), None),
    ("/v1/chat/completions", _chat(tools=[TOOL], tool_choice="none"), None),
    ("/generate", {"text": "a", "sampling_params": {"json_schema": json.dumps(SCHEMA)}},
     GrammarSpec("json_schema", json.dumps(SCHEMA))),
    ("/generate", {"text": "a", "sampling_params": {"regex": "[0-9]+"}},
     GrammarSpec("regex", "[0-9]+")),
    ("/generate", {"text": "a", "sampling_params": {"ebnf": 'root ::= "x"'}},
     GrammarSpec("ebnf", 'root ::= "x"')),
])
def test_the_constraint_reaches_the_backend(client: httpx.Client, backend: FakeBackend,
                                            path: str, body: dict[str, Any],
                                            want: GrammarSpec | None) -> None:
    r = client.post(path, json=body)
    assert r.status_code == 200, r.text
    assert backend.inputs[0].sampling.grammar == want


@pytest.mark.parametrize(("path", "body", "words"), [
    ("/v1/chat/completions", _chat(tools=[TOOL]), "tool calls are not parsed"),
    ("/v1/completions", {"prompt": "a", "tools": [TOOL], "tool_choice": "auto"},
     "tool calls are not parsed"),
    ("/v1/chat/completions", _chat(tool_choice={"type": "function", "function": {"name": "f"}}),
     "tool_choice"),
    ("/v1/chat/completions", _chat(functions=[TOOL["function"]]), "functions"),
    ("/v1/chat/completions", _chat(response_format={"type": "json_schema"}),
     "response_format.json_schema.schema is required"),
    ("/v1/chat/completions", _chat(response_format={"type": "yaml"}), "response_format.type"),
    ("/generate", {"text": "a", "sampling_params": {"regex": "a", "ebnf": 'root ::= "a"'}},
     "at most one output constraint"),
    ("/generate", {"text": "a", "sampling_params": {"json_schema": "{nope"}},
     "json_schema is not valid JSON"),
    ("/generate", {"text": "a", "sampling_params": {"regex": ""}}, "regex: empty"),
])
def test_bad_or_unsupported_constraints_are_400_with_a_message(
        client: httpx.Client, backend: FakeBackend, path: str, body: dict[str, Any],
        words: str) -> None:
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    assert words in r.json()["error"]["message"]
    assert backend.inputs == []  # nothing was started


@pytest.mark.parametrize(("path", "body", "words"), [
    ("/v1/chat/completions", _chat(frequency_penalty=0.5), "frequency_penalty=0.5"),
    ("/v1/completions", {"prompt": "a", "presence_penalty": -1.0}, "presence_penalty=-1.0"),
    ("/v1/chat/completions", _chat(repetition_penalty=1.2), "repetition_penalty=1.2"),
    ("/v1/chat/completions", _chat(logit_bias={"50256": -100}), "logit_bias"),
    ("/v1/completions", {"prompt": "a", "min_tokens": 4}, "min_tokens=4"),
    ("/generate", {"text": "a", "sampling_params": {"frequency_penalty": 1.0}},
     "frequency_penalty=1.0"),
    ("/generate", {"text": "a", "sampling_params": {"min_new_tokens": 2}}, "min_tokens=2"),
    ("/generate", {"text": "a", "sampling_params": {"logit_bias": {"7": 5.0}}}, "logit_bias"),
])
def test_sampling_controls_not_applied_are_400_not_ignored(
        client: httpx.Client, backend: FakeBackend, path: str, body: dict[str, Any],
        words: str) -> None:
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert words in message and "not supported" in message
    assert backend.inputs == []


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions", _chat(frequency_penalty=0, presence_penalty=0.0,
                                   repetition_penalty=1.0, logit_bias={}, min_tokens=0)),
    ("/generate", {"text": "a", "sampling_params": {
        "frequency_penalty": 0.0, "presence_penalty": 0, "repetition_penalty": 1,
        "min_new_tokens": 0, "logit_bias": None}}),
])
def test_neutral_values_of_those_controls_pass(client: httpx.Client, backend: FakeBackend,
                                               path: str, body: dict[str, Any]) -> None:
    r = client.post(path, json=body)
    assert r.status_code == 200, r.text
    assert len(backend.inputs) == 1
