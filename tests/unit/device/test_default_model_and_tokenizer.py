"""The embedded default model directory and the tokenizer wrapper."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from decode_worker.cli import main
from decode_worker.device.default_model import (
    EOS_TOKEN_ID,
    EOS_TOKEN_IDS,
    FORMAT_VERSION,
    VOCAB_SIZE,
    ensure_default_model,
)
from decode_worker.device.model.config import GptOssConfig
from decode_worker.device.tokenizer import Tokenizer
from decode_worker.errors import ClientError


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_default_model(tmp_path_factory.mktemp("cache"), seed=0)


def test_ensure_is_idempotent_and_race_safe(tmp_path: Path) -> None:
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(ensure_default_model(tmp_path, 3)))
               for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(set(results)) == 1
    first = (results[0] / "model.safetensors").read_bytes()
    assert ensure_default_model(tmp_path, 3) == results[0]
    assert (results[0] / "model.safetensors").read_bytes() == first
    assert [p.name for p in tmp_path.iterdir()] == [results[0].name]  # no temp dirs left


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path: Path) -> None:
    a = ensure_default_model(tmp_path / "a", 0).joinpath("model.safetensors").read_bytes()
    b = ensure_default_model(tmp_path / "b", 0).joinpath("model.safetensors").read_bytes()
    c = ensure_default_model(tmp_path / "c", 1).joinpath("model.safetensors").read_bytes()
    assert a == b != c


def test_make_model_cli_writes_a_loadable_directory(tmp_path: Path) -> None:
    out = tmp_path / "m"
    assert main(["make-model", str(out), "--set", "model.seed=0"]) == 0
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json",
            "tokenizer_config.json"} <= names
    cfg = GptOssConfig.from_file(out / "config.json")
    assert (cfg.window, cfg.sliding_layers, cfg.full_layers) == (127, (0, 2), (1, 3))


def test_byte_tokenizer_round_trips_any_text(model_dir: Path) -> None:
    tok = Tokenizer.from_dir(model_dir)
    text = "héllo, wörld! 日本 \n\t🙂"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.vocab_size == VOCAB_SIZE == 264
    assert tok.eos_token_ids == EOS_TOKEN_IDS == (262, EOS_TOKEN_ID, 263)  # gpt-oss's order
    assert tok.encode("<|endoftext|>") == [EOS_TOKEN_ID]
    assert tok.decode([*tok.encode("hi"), EOS_TOKEN_ID]) == "hi"


def test_the_cache_dir_names_the_format_version(model_dir: Path) -> None:
    assert FORMAT_VERSION == 2 and model_dir.name == "tiny-gpt-oss-v2-seed0"


def test_chat_template_renders_harmony_and_the_builtin_fallback(model_dir: Path) -> None:
    tok = Tokenizer.from_dir(model_dir)
    assert tok.chat_template is not None
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    rendered = tok.apply_chat_template(messages)
    assert rendered.startswith("<|start|>system<|message|>")
    assert "# Valid channels: analysis, commentary, final." in rendered
    assert rendered.endswith("<|start|>developer<|message|># Instructions\n\nbe brief<|end|>"
                             "<|start|>user<|message|>hi<|end|><|start|>assistant")
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    with_tools = tok.apply_chat_template(messages, tools=[tool])
    assert "type f = (_: {\"type\": \"object\"}) => any;" in with_tools
    assert "Calls to these tools must go to the commentary channel" in with_tools
    for sp in ("<|channel|>", "<|message|>", "<|start|>"):  # the markers are single tokens
        assert len(tok.encode(sp)) == 1
    tok.chat_template = None  # no template in the directory: the plain built-in one
    assert tok.apply_chat_template(messages) == (
        "<|start|>system<|message|>be brief<|end|><|start|>user<|message|>hi<|end|>"
        "<|start|>assistant<|message|>")


def test_transformers_tokenizer_agrees(model_dir: Path) -> None:
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoTokenizer.from_pretrained(model_dir)
    text = "abc <|start|>x"
    assert ref.encode(text, add_special_tokens=False) == Tokenizer.from_dir(model_dir).encode(text)


def test_template_raise_exception_is_a_client_error(model_dir: Path) -> None:
    tok = Tokenizer.from_dir(model_dir)
    tok.chat_template = (
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}"
        "{{ strftime_now('%Y') | length }}")
    with pytest.raises(ClientError, match="user first"):
        tok.apply_chat_template([{"role": "system", "content": "x"}])
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "4"
