"""Structured output on the built-in tiny model (random weights: only the grammar makes its output
valid): compiled-grammar cache, per-request matchers that catch up, the batched mask."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest
import torch

from decode_worker.core.sampling import GrammarSpec, SamplingParams
from decode_worker.device.default_model import write_model
from decode_worker.device.grammar import GrammarCache, GrammarState, mask_logits
from decode_worker.device.kv_pool import KVPools, KVSpec
from decode_worker.device.model.weights import load_model
from decode_worker.device.runner import ModelRunner
from decode_worker.device.sampler import Sampler, SampleRow
from decode_worker.device.tokenizer import Tokenizer
from decode_worker.errors import ClientError
from decode_worker.utils.mathx import cdiv
from tests.decode_steps import decode_lists

jsonschema = pytest.importorskip("jsonschema")

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "pet"],
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "pet": {"enum": ["cat", "dog", "none"]}}}
PAGE = 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("grammar") / "tiny-gpt-oss", seed=0)


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(model_dir)


@pytest.fixture(scope="module")
def cache(tokenizer: Tokenizer) -> GrammarCache:
    return GrammarCache(tokenizer)


@pytest.fixture(scope="module")
def runner(model_dir: Path) -> ModelRunner:
    model = load_model(model_dir, "cpu", torch.float32)
    pools = KVPools(KVSpec.from_config(model.cfg), 256, 256, PAGE, "cpu", torch.float32)
    return ModelRunner(model, pools, use_cuda_graph=False, graph_batch_sizes=[1])


def generate(runner: ModelRunner, prompts: list[list[int]], params: list[SamplingParams],
             max_new: int, eos: int) -> list[list[int]]:
    """Prefill each prompt and sample its first token with a prefill-side grammar state (as the
    prefill peer does), then decode the batch with fresh decode-side states that catch up from
    the output ids (the first token included). Rows stop at `eos`."""
    sampler = Sampler(seed=0)
    outs: list[list[int]] = []
    tables: list[list[int]] = []
    next_page = 1
    for prompt, sp in zip(prompts, params, strict=True):
        pages = list(range(next_page, next_page + cdiv(len(prompt) + max_new, PAGE)))
        next_page += len(pages)
        logits = runner.prefill(prompt, pages, pages)  # [V] f32
        row = SampleRow(sp, grammar=GrammarState.for_sampling(sp))
        outs.append([sampler.sample(logits[None], [row]).token_ids[0]])
        tables.append(pages)
    states = [GrammarState.for_sampling(sp) for sp in params]  # the decode side's own
    live = [i for i, out in enumerate(outs) if out[-1] != eos]
    while live and max(len(outs[i]) for i in live) < max_new:
        logits = decode_lists(runner, [outs[i][-1] for i in live],
                              [len(prompts[i]) + len(outs[i]) - 1 for i in live],
                              [tables[i] for i in live], [tables[i] for i in live])  # [bs, V]
        rows = []
        for i in live:
            state = states[i]
            if state is not None:
                state.catch_up(outs[i])
            rows.append(SampleRow(params[i], step=len(outs[i]), grammar=state))
        for i, token in zip(live, sampler.sample(logits, rows).token_ids, strict=True):
            outs[i].append(token)
        live = [i for i in live if outs[i][-1] != eos and len(outs[i]) < max_new]
    return outs


def test_json_schema_output_validates_for_20_seeded_prompts(
        runner: ModelRunner, tokenizer: Tokenizer, cache: GrammarCache) -> None:
    rng = random.Random(16)
    prompts = [[rng.randrange(256) for _ in range(rng.randrange(5, 30))] for _ in range(20)]
    spec = GrammarSpec("json_schema", json.dumps(PERSON))
    params = [cache.prepare(SamplingParams(temperature=1.0, seed=i, grammar=spec))
              for i in range(20)]
    eos = tokenizer.eos_token_ids[0]
    outs = generate(runner, prompts, params, max_new=96, eos=eos)
    for i, out in enumerate(outs):
        assert out[-1] == eos, (i, tokenizer.decode(out))
        jsonschema.validate(json.loads(tokenizer.decode(out[:-1])), PERSON)
    assert cache.num_compiled == 1  # compiled once for the 20 requests
    unconstrained = generate(runner, prompts[:4], [SamplingParams(seed=i) for i in range(4)],
                             max_new=20, eos=eos)
    assert not any(_is_json(tokenizer.decode(o)) for o in unconstrained)  # the test can fail


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


@pytest.mark.parametrize(("kind", "source", "check"), [
    ("regex", r"[a-z]{3}-[0-9]{2}", lambda t: re.fullmatch(r"[a-z]{3}-[0-9]{2}", t)),
    ("ebnf", 'root ::= "yes" | "no" | "maybe " [0-9]', lambda t: re.fullmatch(
        r"yes|no|maybe [0-9]", t)),
])
def test_regex_and_ebnf_outputs_match(
        runner: ModelRunner, tokenizer: Tokenizer, cache: GrammarCache, kind: str, source: str,
        check: object) -> None:
    params = [cache.prepare(SamplingParams(temperature=1.0, seed=i, grammar=GrammarSpec(
        kind, source))) for i in range(6)]  # type: ignore[arg-type]
    eos = tokenizer.eos_token_ids[0]
    outs = generate(runner, [[7, 8, 9 + i] for i in range(6)], params, max_new=200, eos=eos)
    for out in outs:
        assert out[-1] == eos
        assert check(tokenizer.decode(out[:-1])), tokenizer.decode(out)  # type: ignore[operator]


@pytest.mark.parametrize(("spec", "words"), [
    (GrammarSpec("json_schema", '{"type": "strin"}'), "strin"),
    (GrammarSpec("json_schema", "{not json"), "not valid JSON"),
    (GrammarSpec("regex", "([a-z]"), "parenthesis"),
    (GrammarSpec("ebnf", "root ::= missing"), "missing"),
])
def test_what_xgrammar_cannot_compile_is_a_client_error_with_its_message(
        cache: GrammarCache, spec: GrammarSpec, words: str) -> None:
    with pytest.raises(ClientError) as err:
        cache.prepare(SamplingParams(grammar=spec))
    assert words in str(err.value) and err.value.status == 400
    assert not str(err.value).split(": ", 1)[1].startswith("[")  # xgrammar's log prefix cut


def test_cache_compiles_once_per_spec_and_drops_least_recent(tokenizer: Tokenizer) -> None:
    small = GrammarCache(tokenizer, max_entries=2)
    a, b, c = (GrammarSpec("regex", r) for r in ("a+", "b+", "c+"))
    first = small.compile(a)
    assert small.compile(a) is first and small.num_compiled == 1
    small.compile(b)
    small.compile(a)  # a is now the most recent: c pushes b out
    small.compile(c)
    small.compile(a)
    assert small.num_compiled == 3
    small.compile(b)
    assert small.num_compiled == 4


def test_terminated_grammar_allows_only_stop_tokens(tokenizer: Tokenizer,
                                                    cache: GrammarCache) -> None:
    sp = cache.prepare(SamplingParams(stop_token_ids=(42,), grammar=GrammarSpec("regex", "ok")))
    state = GrammarState.for_sampling(sp)
    assert state is not None
    eos = tokenizer.eos_token_ids[0]
    state.catch_up([*tokenizer.encode("ok"), eos])
    assert state.num_accepted == 3 and state.matcher.is_terminated()
    vocab = tokenizer.vocab_size + 12  # a model vocab padded past the tokenizer's
    masked = mask_logits(torch.zeros(2, vocab), [None, state])
    assert masked[0].isfinite().all()  # the unconstrained row is untouched
    assert set(masked[1].isfinite().nonzero()[:, 0].tolist()) == {*tokenizer.eos_token_ids, 42}


def test_padded_vocab_ids_and_forbidden_tokens_are_never_sampled_logprobs_stay_raw(
        tokenizer: Tokenizer, cache: GrammarCache) -> None:
    sp = cache.prepare(SamplingParams(temperature=0.0, grammar=GrammarSpec("regex", "[xy]")))
    vocab = tokenizer.vocab_size + 20
    logits = torch.zeros(1, vocab)
    logits[0, -1] = 50.0  # a padded id the model likes best
    logits[0, ord("z")] = 40.0  # and a token the grammar forbids
    row = SampleRow(sp, return_logprob=True, grammar=GrammarState.for_sampling(sp))
    out = Sampler(seed=0).sample(logits, [row])
    assert out.token_ids[0] in (ord("x"), ord("y"))
    raw = torch.log_softmax(logits, -1)[0, out.token_ids[0]].item()
    assert out.logprobs[0] == pytest.approx(raw)


def test_a_batch_without_grammar_does_no_mask_work(monkeypatch: pytest.MonkeyPatch) -> None:
    import decode_worker.device.sampler as sampler_mod

    def boom(*_: object) -> None:
        raise AssertionError("mask work on an unconstrained batch")

    monkeypatch.setattr(sampler_mod, "mask_logits", boom)
    out = Sampler(seed=0).sample(torch.randn(3, 50), [SampleRow(SamplingParams())] * 3)
    assert len(out.token_ids) == 3


def test_a_token_outside_the_grammar_leaves_the_rest_unconstrained(
        cache: GrammarCache) -> None:
    sp = cache.prepare(SamplingParams(grammar=GrammarSpec("regex", "a+")))
    state = GrammarState.for_sampling(sp)
    assert state is not None
    state.catch_up([ord("b")])  # e.g. a prefill peer that ignored the grammar
    assert state.rejected == ord("b") and not state.is_active
    logits = torch.randn(1, 300)
    assert mask_logits(logits, [state]) is logits


@pytest.mark.parametrize("string", [{"type": "string", "maxLength": 4}, {"type": "string"}])
def test_json_strings_refuse_raw_control_characters_and_encoded_surrogates(
        cache: GrammarCache, string: dict[str, object]) -> None:
    """xgrammar <= 0.2.9 let a maxLength string take a raw TAB (invalid JSON), and any string
    the UTF-8 bytes of a surrogate (no text); ours take neither, but escapes and real UTF-8."""
    schema = {"type": "object", "properties": {"s": string}, "required": ["s"]}
    sp = cache.prepare(SamplingParams(grammar=GrammarSpec("json_schema", json.dumps(schema))))

    def fresh() -> GrammarState:
        state = GrammarState.for_sampling(sp)
        assert state is not None and state.matcher.accept_string('{"s": "a')
        return state

    assert not fresh().matcher.accept_token(ord("\t"))
    surrogate = fresh()
    assert surrogate.matcher.accept_token(0xED)  # a lead byte of U+D000..U+D7FF
    assert not surrogate.matcher.accept_token(0xA0)  # but ED A0 starts U+D800
    ok = fresh()
    assert all(ok.matcher.accept_token(b) for b in "€".encode())
    assert ok.matcher.accept_string('\\n"}') and ok.matcher.is_completed()


def test_json_object_takes_any_object_and_nothing_else(cache: GrammarCache) -> None:
    sp = cache.prepare(SamplingParams(grammar=GrammarSpec("json_object")))
    for text, ok in (('{"a": [1, {"b": null}], "c": "d"}', True), ("[1]", False),
                     ('"x"', False)):
        state = GrammarState.for_sampling(sp)
        assert state is not None
        assert state.matcher.accept_string(text) == ok
        assert state.matcher.is_completed() == ok
