"""Structured output across P/D (issue 16): the reference prefill peer samples the first token under
the grammar, the decode worker's matcher accepts it and constrains the rest. The tiny model has
random weights: only the grammar on both sides makes the answer valid JSON (a prefill peer that
ignored it, or a decode side that started its grammar over, gives text that does not parse)."""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from decode_worker.daemon.shared.procs import http_json
from decode_worker.errors import DecodeWorkerError
from tests.e2e import driver

jsonschema = pytest.importorskip("jsonschema")
pytestmark = pytest.mark.slow
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "pet"],
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "pet": {"enum": ["cat", "dog", "none"]}}}
NUM_PROMPTS = 6


def _pd(workers: driver.Workers, path: str, body: dict[str, Any]) -> tuple[Any, Any]:
    """The router's part: the same body, with a fresh room, to the prefill peer and the decode
    worker; (prefill reply, decode reply)."""
    body = {**body, "bootstrap_host": "127.0.0.1", "bootstrap_port": workers.boot_port,
            "bootstrap_room": random.getrandbits(63)}
    with ThreadPoolExecutor(1) as pool:
        pre = pool.submit(http_json, f"{workers.prefill.url}{path}", body)
        out = http_json(f"{workers.decode.url}{path}", body)
        return pre.result(), out


@pytest.mark.parametrize("protocol", ["native", "sglang"])
def test_json_schema_output_parses_with_the_first_token_from_the_prefill_peer(
        plain_pd: Callable[[str], driver.Workers], protocol: str) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    workers = plain_pd(protocol)
    for i in range(NUM_PROMPTS):
        body = {"messages": [{"role": "user", "content": f"Describe person {i}."}],
                "response_format": fmt, "max_tokens": 64, "temperature": 1.0, "seed": i}
        pre, dec = _pd(workers, "/v1/chat/completions", body)
        text = dec["choices"][0]["message"]["content"]
        assert dec["choices"][0]["finish_reason"] == "stop", (i, text)
        jsonschema.validate(json.loads(text), PERSON)
        assert text.startswith(pre["choices"][0]["message"]["content"])  # its first token
    regex = {"input_ids": [5, 6, 7], "sampling_params": {
        "regex": "(yes|no), [0-9]{2}", "temperature": 1.0, "max_new_tokens": 16}}
    _, out = _pd(workers, "/generate", regex)
    assert out["meta_info"]["finish_reason"]["type"] == "stop", out
    assert re.fullmatch("(yes|no), [0-9]{2}", out["text"]), out["text"]


def test_a_schema_xgrammar_cannot_compile_is_400_on_both_servers(
        plain_pd: Callable[[str], driver.Workers]) -> None:
    bad = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4,
           "response_format": {"type": "json_schema", "json_schema": {
               "name": "bad", "schema": {"type": "strin"}}}}
    workers = plain_pd("native")
    for url in (workers.prefill.url, workers.decode.url):
        with pytest.raises(DecodeWorkerError) as err:
            http_json(f"{url}/v1/chat/completions", {
                **bad, "bootstrap_host": "127.0.0.1", "bootstrap_port": workers.boot_port,
                "bootstrap_room": random.getrandbits(63)}, timeout_s=30)
        assert "HTTP 400" in str(err.value) and "strin" in str(err.value), err.value
    tools = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4,  # issue 24
             "tools": [{"type": "function", "function": {"name": "f"}}],
             "tool_choice": {"type": "function", "function": {"name": "g"}}}
    with pytest.raises(DecodeWorkerError) as err:
        http_json(f"{workers.decode.url}/v1/chat/completions", tools, timeout_s=30)
    assert "HTTP 400" in str(err.value) and "not in `tools`" in str(err.value)
    legacy = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4,
              "functions": [{"name": "f"}]}
    with pytest.raises(DecodeWorkerError) as err:
        http_json(f"{workers.decode.url}/v1/chat/completions", legacy, timeout_s=30)
    assert "HTTP 400" in str(err.value) and "tool calls are not parsed" in str(err.value)
    ok = http_json(f"{workers.decode.url}/v1/chat/completions", {
        "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}, timeout_s=30)
    assert ok["choices"][0]["finish_reason"] in ("length", "stop")  # still serving
