"""A forced harmony tool call (`tool_choice` required / named) as an xgrammar structural tag
over the tiny model's tokenizer: the special tokens only where the tag names them by id, the
arguments by the tool's schema, and a random-weight model's constrained output parses as a call
whose arguments validate."""

from __future__ import annotations

import json

import pytest
import torch

from decode_worker.core.sampling import SamplingParams
from decode_worker.device.default_model import EOS_TOKEN_IDS, byte_tokenizer
from decode_worker.device.grammar import GrammarCache, GrammarState, mask_logits
from decode_worker.device.tokenizer import Tokenizer
from decode_worker.io.api.harmony import HarmonyTokens, parse
from decode_worker.io.api.harmony.tools import plan_tools

jsonschema = pytest.importorskip("jsonschema")
TOK = Tokenizer(byte_tokenizer(), EOS_TOKEN_IDS)
T = HarmonyTokens.of(TOK)
assert T is not None
CITY = {"type": "object", "additionalProperties": False, "required": ["city"],
        "properties": {"city": {"type": "string", "maxLength": 6}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": CITY}},
         {"type": "function", "function": {"name": "noop", "parameters": {
             "type": "object", "properties": {}, "additionalProperties": False}}}]


@pytest.fixture(scope="module")
def cache() -> GrammarCache:
    return GrammarCache(TOK)


def _state(cache: GrammarCache, choice: object) -> GrammarState:
    assert T is not None
    plan = plan_tools(TOOLS, choice, T)
    assert plan.grammar is not None
    state = GrammarState.for_sampling(cache.prepare(SamplingParams(grammar=plan.grammar)))
    assert state is not None
    return state


def _allowed(state: GrammarState) -> set[int]:
    masked = mask_logits(torch.zeros(1, TOK.vocab_size), [state])
    return set(masked[0].isfinite().nonzero()[:, 0].tolist())


def test_named_call_accepts_the_call_and_no_special_token_inside_it(cache: GrammarCache) -> None:
    assert T is not None
    state = _state(cache, {"type": "function", "function": {"name": "get_weather"}})
    assert _allowed(state) == {T.channel}  # the call is the whole turn
    head = [T.channel, *TOK.encode("commentary to=functions.get_weather "), T.constrain,
            *TOK.encode("json"), T.message, *TOK.encode('{"city": "Pa')]
    state.catch_up(head)
    assert state.is_active and not _allowed(state) & T.all_ids  # no marker inside a string
    state.catch_up([*head, *TOK.encode('ris"}'), T.call])
    assert state.is_active and state.matcher.is_terminated()


def test_required_lets_the_model_pick_any_tool(cache: GrammarCache) -> None:
    assert T is not None
    state = _state(cache, "required")
    state.catch_up([T.channel, *TOK.encode("commentary to=functions.")])
    assert {ord("g"), ord("n")} <= _allowed(state)
    bare = plan_tools([{"type": "function", "function": {"name": "bare"}}], "required", T)
    assert bare.grammar is not None and cache.compile(bare.grammar) is not None  # any object


@pytest.mark.parametrize("seed", range(8))
def test_random_logits_under_the_grammar_parse_as_a_valid_call(cache: GrammarCache,
                                                               seed: int) -> None:
    state = _state(cache, "required")
    gen = torch.Generator().manual_seed(seed)
    out: list[int] = []
    while not state.matcher.is_terminated() and len(out) < 200:
        masked = mask_logits(torch.randn(1, TOK.vocab_size, generator=gen) * 3, [state])
        out.append(int(torch.multinomial(masked.softmax(-1), 1, generator=gen)))
        state.catch_up(out)
    assert T is not None
    [call] = parse(out, T, TOK).calls
    assert call.complete and call.name in ("get_weather", "noop")
    args = json.loads(call.arguments)
    jsonschema.validate(args, CITY if call.name == "get_weather" else TOOLS[1]["function"][
        "parameters"])
