"""The model registry: which family a config.json picks, the errors a bad config or checkpoint
stops the start with (one line naming the field, or the tensor and both shapes), checkpoints
in several files and dtypes, FP8 block-quantized weights, and RoPE variants against
transformers' own computation."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from decode_worker.device.model.arch import ModelConfig
from decode_worker.device.model.catalog import table
from decode_worker.device.model.checkpoint import INDEX, dequantize_fp8_block
from decode_worker.device.model.registry import FAMILIES, family_of, load_model
from decode_worker.device.model.rope import RopeSpec, inv_freq
from decode_worker.device.model.tiny import tiny_config, write_tiny_model
from decode_worker.errors import ClientError, ConfigError


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("qwen3") / "m", "qwen3")


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_moe", "gemma3", "gpt-oss"])
def test_each_tiny_config_picks_its_family(family: str) -> None:
    raw = tiny_config(family) if family != "gpt-oss" else FAMILIES[0].tiny_config(264)
    assert family_of(raw).name == family
    assert family_of({"model_type": raw["model_type"]}).name == family  # no architectures


def test_an_unsupported_architecture_is_one_line_naming_it_and_the_supported_list() -> None:
    with pytest.raises(ConfigError) as err:
        family_of({"architectures": ["MistralForCausalLM"], "model_type": "mistral"}, "cfg")
    text = str(err.value)
    assert "\n" not in text
    assert "architectures=['MistralForCausalLM']" in text and "model_type='mistral'" in text
    for name in ("GptOssForCausalLM", "LlamaForCausalLM", "Qwen3ForCausalLM",
                 "Qwen3MoeForCausalLM", "Gemma3ForCausalLM"):
        assert name in text


@pytest.mark.parametrize(("family", "change", "needle"), [
    ("qwen3", {"hidden_size": None}, "config field 'hidden_size' is missing"),
    ("llama", {"num_attention_heads": "32"}, "config field 'num_attention_heads' must be"),
    ("qwen3_moe", {"num_experts": None}, "config field 'num_local_experts' is missing"),
    ("gemma3", {"attn_logit_softcapping": 50.0}, "config field 'attn_logit_softcapping'"),
    ("llama", {"rope_scaling": {"rope_type": "longrope"}}, "rope_type 'longrope'"),
    ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "low_freq_factor"),
    ("gemma3", {"sliding_window": 1}, "config field 'sliding_window'"),
    ("qwen3", {"quantization_config": {"quant_method": "awq"}}, "quant_method='awq'"),
])
def test_a_missing_or_invalid_field_is_named(family: str, change: dict[str, Any],
                                             needle: str) -> None:
    raw = {**tiny_config(family), **change}
    raw = {k: v for k, v in raw.items() if v is not None}
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace("[", r"\[")):
        family_of(raw).read_config(raw, "config.json")


def test_a_tensor_that_does_not_match_its_config_names_it_and_both_shapes(
        qwen3_dir: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in qwen3_dir.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    raw = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**raw, "intermediate_size": 96}))
    with pytest.raises(ConfigError) as err:
        load_model(bad, "cpu")
    assert str(err.value) == ("tensor 'model.layers.0.mlp.gate_proj.weight' has shape "
                              "(128, 64), config implies (96, 64)")


def _logits(model_dir: Path, dtype: torch.dtype) -> torch.Tensor:
    from tests.oracle.test_oracle_families import runner_of

    model = load_model(model_dir, "cpu", dtype)
    runner = runner_of(model, 16, 8)
    return runner.prefill(list(range(40)), list(range(1, 4)), [0, 0, 0])


def test_sharded_bf16_checkpoint_with_index_loads_as_the_single_file(
        qwen3_dir: Path, tmp_path: Path) -> None:
    state = load_file(str(qwen3_dir / "model.safetensors"))
    out = tmp_path / "sharded"
    out.mkdir()
    for f in qwen3_dir.iterdir():
        if f.suffix != ".safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    names = sorted(state)
    shards = {"model-00001-of-00002.safetensors": names[::2],
              "model-00002-of-00002.safetensors": names[1::2]}
    for shard, keys in shards.items():
        save_file({k: state[k].to(torch.bfloat16) for k in keys}, str(out / shard))
    weight_map = {k: shard for shard, keys in shards.items() for k in keys}
    (out / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    single = tmp_path / "single"
    single.mkdir()
    for f in out.iterdir():
        if f.suffix != ".safetensors" and f.name != INDEX:
            (single / f.name).write_bytes(f.read_bytes())
    save_file({k: v.to(torch.bfloat16) for k, v in state.items()},
              str(single / "model.safetensors"))
    assert torch.equal(_logits(out, torch.float32), _logits(single, torch.float32))


def test_fp8_block_weights_are_dequantized_at_load(qwen3_dir: Path, tmp_path: Path) -> None:
    """Every Linear weight stored as e4m3 with 32 x 32 block scales (`weight_scale_inv`):
    the loaded weight is the block-scaled value, and the model's logits stay close to the
    unquantized model's."""
    block = 32
    state = load_file(str(qwen3_dir / "model.safetensors"))
    quant: dict[str, torch.Tensor] = {}
    for name, w in state.items():
        if w.dim() == 2 and "proj" in name:
            scale = w.abs().reshape(w.shape[0] // block, block, w.shape[1] // block, block) \
                .amax(dim=(1, 3)) / 448.0  # [N / 32, K / 32]
            grid = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)  # [N, K]
            quant[name] = (w / grid).to(torch.float8_e4m3fn)
            quant[name + "_scale_inv"] = scale
        else:
            quant[name] = w
    out = tmp_path / "fp8"
    out.mkdir()
    for f in qwen3_dir.iterdir():
        if f.suffix != ".safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    raw = json.loads((qwen3_dir / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                  "weight_block_size": [block, block],
                                  "activation_scheme": "dynamic"}
    (out / "config.json").write_text(json.dumps(raw))
    save_file(quant, str(out / "model.safetensors"))
    name = "model.layers.0.self_attn.o_proj.weight"
    want = dequantize_fp8_block(quant[name], quant[name + "_scale_inv"], (block, block))
    model = load_model(out, "cpu")
    assert torch.equal(model.layers[0].o_w, want)  # type: ignore[attr-defined]
    diff = (_logits(out, torch.float32) - _logits(qwen3_dir, torch.float32)).abs().max()
    assert 0 < diff.item() < 0.05


@pytest.mark.parametrize("scaling", [
    None,
    {"rope_type": "linear", "factor": 8.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
])
def test_rope_variants_match_transformers(scaling: dict[str, Any] | None) -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = LlamaConfig(hidden_size=1024, num_attention_heads=8, head_dim=128, rope_theta=5e5,
                     rope_scaling=scaling, max_position_embeddings=131072)
    kind = (scaling or {}).get("rope_type", "default")
    fn = ROPE_INIT_FUNCTIONS.get(kind)
    ref, ref_scale = (fn(hf, "cpu") if fn else (1.0 / (5e5 ** (
        torch.arange(0, 128, 2, dtype=torch.int64).float() / 128)), 1.0))
    got, scale = inv_freq(RopeSpec.of(scaling or {}, 5e5, "cfg"), 128, 131072)
    assert torch.allclose(got, ref.float(), rtol=1e-6, atol=0)
    assert scale == pytest.approx(ref_scale)


def test_models_table_lists_every_family() -> None:
    text = table()
    for family in FAMILIES:
        assert family.name in text and family.architectures[0] in text
    assert "native, sglang" in text


def test_gemma3_config_reads_pattern_local_rope_and_scale() -> None:
    raw = {**tiny_config("gemma3"), "sliding_window_pattern": 6, "num_hidden_layers": 12}
    cfg = family_of(raw).read_config(raw, "cfg")
    assert isinstance(cfg, ModelConfig)
    assert cfg.full_layers == (5, 11) and cfg.window == 31
    assert cfg.rope["sliding_attention"] == RopeSpec("default", 10000.0, {})
    assert cfg.rope["full_attention"].rope_type == "linear"
    assert cfg.attn_scale == pytest.approx(24 ** -0.5) and cfg.embed_scale == 8.0


def test_models_subcommand_prints_every_family_as_json(capsys: pytest.CaptureFixture[str]
                                                      ) -> None:
    from decode_worker.cli import main

    assert main(["models", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["family"] for r in rows] == [f.name for f in FAMILIES]
    protocols = {r["family"]: r["prefill_protocols"] for r in rows}
    assert protocols["qwen3"] == protocols["gemma3"] == ["native", "sglang"]


def test_demo_family_writes_a_tiny_model_once(tmp_path: Path) -> None:
    import argparse

    from decode_worker.daemon.demo.main import demo_model
    from decode_worker.settings import load_settings

    loaded = load_settings(overrides={"model.cache_dir": str(tmp_path)}, environ={})
    path = demo_model(argparse.Namespace(family="qwen3"), loaded)
    assert path is not None and family_of(json.loads((path / "config.json").read_text())
                                          ).name == "qwen3"
    assert demo_model(argparse.Namespace(family="qwen3"), loaded) == path
    both = load_settings(overrides={"model.cache_dir": str(tmp_path), "model.path": str(path)},
                         environ={})
    with pytest.raises(ConfigError, match="not both"):
        demo_model(argparse.Namespace(family="gemma3"), both)


def test_a_multimodal_gemma3_checkpoint_serves_its_text_model(tmp_path: Path) -> None:
    """model_type gemma3 (Gemma3ForConditionalGeneration): the text_config is read and the
    nested `language_model.model.` tensors load as the text-only checkpoint's."""
    text = write_tiny_model(tmp_path / "text", "gemma3")
    mm = tmp_path / "mm"
    mm.mkdir()
    for f in text.iterdir():
        if f.suffix != ".safetensors":
            (mm / f.name).write_bytes(f.read_bytes())
    raw = json.loads((text / "config.json").read_text())
    (mm / "config.json").write_text(json.dumps({
        "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
        "eos_token_id": raw["eos_token_id"], "text_config": raw, "vision_config": {}}))
    state = load_file(str(text / "model.safetensors"))
    save_file({"language_model." + k: v for k, v in state.items()},
              str(mm / "model.safetensors"))
    assert torch.equal(_logits(mm, torch.float32), _logits(text, torch.float32))


def test_input_ids_are_bounded_by_the_embedding_rows_not_the_tokenizer(qwen3_dir: Path) -> None:
    from decode_worker.device.tokenizer import Tokenizer
    from decode_worker.io.api.common import check_prompt, vocab_size_of

    tok = Tokenizer.from_dir(qwen3_dir)
    rows = json.loads((qwen3_dir / "config.json").read_text())["vocab_size"]
    assert tok.vocab_size < rows == vocab_size_of(tok)
    assert check_prompt([1, rows - 1], None, vocab_size_of(tok)) == [1, rows - 1]
    with pytest.raises(ClientError, match="outside the vocabulary"):
        check_prompt([rows], None, vocab_size_of(tok))
