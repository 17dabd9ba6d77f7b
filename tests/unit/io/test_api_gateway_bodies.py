"""The bodies the SGLang Model Gateway (smg 1.13, PD mode) sends, as recorded in front of the
real servers: they parse, the fields smg adds are accepted, and an extra output this server does
not produce (`return_hidden_states`, `return_entropy`, `return_bytes` set to true) is a 400."""

from __future__ import annotations

import json

import pytest

from decode_worker.errors import ClientError
from decode_worker.io.api.schemas import ChatReq, CompletionReq, GenerateReq, decode_body

BOOT = {"bootstrap_host": "127.0.0.1", "bootstrap_port": 9101, "bootstrap_room": 5099222338}
GENERATE = {"text": "hello world", "model": "unknown",  # smg fills in a model it does not know
            "sampling_params": {"temperature": 0.0, "max_new_tokens": 4},
            "return_text_in_logprobs": False, "stream": False, "log_metrics": True,
            "background": False, "no_logs": False, "return_bytes": False,
            "return_entropy": False, **BOOT}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "model": "/m", "logprobs": False,
        "max_tokens": 4, "stream": False, "temperature": 0.0, **BOOT}
COMPLETION = {"model": "/m", "prompt": "hello", "echo": False, "max_tokens": 4,
              "stream": False, **BOOT}


def test_what_smg_sends_parses() -> None:
    gen = decode_body(json.dumps(GENERATE).encode(), GenerateReq)
    assert gen.bootstrap_room == BOOT["bootstrap_room"] and gen.text == "hello world"
    chat = decode_body(json.dumps(CHAT).encode(), ChatReq)
    assert chat.max_tokens == 4 and chat.bootstrap_port == 9101  # smg keeps max_tokens
    assert decode_body(json.dumps(COMPLETION).encode(), CompletionReq).max_tokens == 4


@pytest.mark.parametrize("field", ["return_hidden_states", "return_entropy", "return_bytes"])
def test_an_extra_output_we_do_not_produce_is_refused(field: str) -> None:
    for body, kind in ((GENERATE, GenerateReq), (CHAT, ChatReq)):
        with pytest.raises(ClientError, match=f"{field}=true is not supported"):
            decode_body(json.dumps({**body, field: True}).encode(), kind)
