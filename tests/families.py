"""Tiny checkpoints of every non-gpt-oss family written by transformers itself
(`save_pretrained`), then config.json rewritten in the hub's keys (what real checkpoints carry);
transformers' own form is kept beside it as `config.transformers.json`. Used by the session
fixture `family_dirs` (tests/conftest.py): each is written once per session."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from decode_worker.device.model.tiny import tiny_config, write_tokenizer

FAMILIES = ("llama", "qwen3", "qwen3_moe", "gemma3")
NORM_STD = 0.05  # norms moved off their init (1, or 0 for Gemma's 1 + w) so they matter


def write_hf_checkpoint(out_dir: Path, family: str, seed: int = 0) -> Path:
    """A tiny `family` model initialised and saved by transformers (float32)."""
    import transformers

    out_dir.mkdir(parents=True, exist_ok=True)
    hub = tiny_config(family)
    (out_dir / "config.json").write_text(json.dumps(hub, indent=2) + "\n")
    config = transformers.AutoConfig.from_pretrained(out_dir)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * NORM_STD)
    model.save_pretrained(out_dir)
    (out_dir / "config.transformers.json").write_text((out_dir / "config.json").read_text())
    (out_dir / "config.json").write_text(json.dumps(hub, indent=2) + "\n")
    write_tokenizer(out_dir, family, int(hub["max_position_embeddings"]))
    return out_dir


def reference_model(model_dir: Path) -> Any:
    """transformers' model of the directory, float32, eager attention."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager")
    return model.eval()
