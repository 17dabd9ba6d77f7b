"""Tiny seeded random models of every family, written locally like the default gpt-oss
(`decode-worker demo --family qwen3`): config.json in the hub's keys (`Family.tiny_config`),
safetensors with the hub's tensor names, and a byte-level tokenizer with the family's special
tokens and chat template (`chat_templates.py`).

The embedding has VOCAB_ROWS rows, more than the tokenizer's 256 bytes + specials, as real
checkpoints pad it (Qwen3: 151,936 rows over 151,669 tokens): input ids are bounded by the rows.
Weights are N(0, 0.02); RMSNorm weights 1 + N(0, 0.02) (Gemma's, stored as an offset from 1,
N(0, 0.02)). Written with `safetensors` and `tokenizers` only; transformers loads the
directory with `AutoModelForCausalLM.from_pretrained`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from decode_worker.device.default_model import (
    byte_tokenizer,
    ensure_default_model,
    write_once,
)
from decode_worker.device.model import chat_templates
from decode_worker.device.model.arch import ModelConfig
from decode_worker.device.model.decoder_weights import tensor_shapes
from decode_worker.device.model.registry import family_named

FORMAT_VERSION = 1
VOCAB_ROWS = 320
INIT_STD = 0.02
# family -> (special tokens from id 256 on, EOS tokens, BOS token or None, chat template)
TOKENS: dict[str, tuple[tuple[str, ...], tuple[str, ...], str | None, str]] = {
    "qwen3": (("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>",
               "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"),
              ("<|im_end|>", "<|endoftext|>"), None, chat_templates.QWEN3_TEMPLATE),
    "llama": (("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
               "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"),
              ("<|eot_id|>", "<|end_of_text|>", "<|eom_id|>"), "<|begin_of_text|>",
              chat_templates.LLAMA3_TEMPLATE),
    "gemma3": (("<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"),
               ("<end_of_turn>", "<eos>"), "<bos>", chat_templates.GEMMA3_TEMPLATE),
}
TOKENS["qwen3_moe"] = TOKENS["qwen3"]
# added tokens that are not special, as Qwen3's tokenizer has them (decoded text keeps them)
PLAIN = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>",
         "</tool_response>")


def special_ids(family: str) -> dict[str, int]:
    """Special token -> id in the tiny tokenizer of `family` (256, 257, ...)."""
    return {tok: 256 + i for i, tok in enumerate(TOKENS[family][0])}


def tiny_config(family: str) -> dict[str, Any]:
    """The config.json of the tiny `family` model, hub keys, EOS / BOS ids set."""
    _specials, eos, bos, _ = TOKENS[family]
    ids = special_ids(family)
    cfg = family_named(family).tiny_config(VOCAB_ROWS)
    cfg["eos_token_id"] = [ids[t] for t in eos]
    cfg["bos_token_id"] = ids[bos] if bos else None
    return cfg


def write_tokenizer(out_dir: Path, family: str, max_len: int) -> None:
    """tokenizer.json, tokenizer_config.json (chat template) and generation_config.json."""
    specials, eos, bos, template = TOKENS[family]
    ids = special_ids(family)
    byte_tokenizer(specials, PLAIN).save(str(out_dir / "tokenizer.json"))
    tok_cfg: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast",
                               "eos_token": eos[0], "pad_token": specials[0],
                               "chat_template": template, "model_max_length": max_len}
    if bos:
        tok_cfg["bos_token"] = bos
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    gen = {"eos_token_id": [ids[t] for t in eos], "do_sample": False}
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")


def random_state_dict(cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """Hub-named float32 tensors drawn in name order from one seeded generator."""
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for name, shape in sorted(tensor_shapes(cfg).items()):
        t = torch.randn(shape, generator=gen) * INIT_STD  # [shape] f32
        is_norm = name.endswith("norm.weight")
        state[name] = t + 1.0 if is_norm and not cfg.norm_offset else t
    return state


def write_tiny_model(out_dir: Path, family: str, seed: int = 0) -> Path:
    """Write the tiny `family` model into `out_dir` (created; files overwritten)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    raw = tiny_config(family)
    (out_dir / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    cfg = family_named(family).read_config(raw, str(out_dir / "config.json"))
    assert isinstance(cfg, ModelConfig)
    save_file(random_state_dict(cfg, seed), str(out_dir / "model.safetensors"),
              metadata={"format": "pt"})
    write_tokenizer(out_dir, family, cfg.max_position_embeddings)
    return out_dir


def ensure_tiny_model(cache_dir: Path, family: str, seed: int = 0) -> Path:
    """The tiny `family` model's directory under `cache_dir`, written once (gpt-oss: the
    default model). Safe when processes race (a private temp dir renamed into place)."""
    name = family_named(family).name
    if name == "gpt-oss":
        return ensure_default_model(cache_dir, seed)
    final = Path(cache_dir) / f"tiny-{name}-v{FORMAT_VERSION}-seed{seed}"
    return write_once(final, lambda tmp: write_tiny_model(tmp, name, seed))
