"""The model registry: a checkpoint's config.json `architectures` (else `model_type`) picks its
family; the family reads the config and the matching loader builds the model.

    gpt-oss     GptOssForCausalLM                 weights.py (MXFP4 experts, sinks)
    llama       LlamaForCausalLM                  decoder_weights.py (shared decoder)
    qwen3       Qwen3ForCausalLM                  decoder_weights.py
    qwen3_moe   Qwen3MoeForCausalLM               decoder_weights.py
    gemma3      Gemma3ForCausalLM / gemma3_text   decoder_weights.py

Anything else stops the start with one line naming `architectures` / `model_type` and the
supported list.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from decode_worker.device.model.arch import ModelConfig
from decode_worker.device.model.base import ArchFacts, CausalLM
from decode_worker.device.model.checkpoint import Checkpoint
from decode_worker.device.model.decoder_weights import load_decoder
from decode_worker.device.model.families import gemma3, gpt_oss, llama, qwen3, qwen3_moe
from decode_worker.device.model.families.common import Family
from decode_worker.errors import ConfigError

log = logging.getLogger(__name__)

FAMILIES: tuple[Family, ...] = (gpt_oss.FAMILY, llama.FAMILY, qwen3.FAMILY, qwen3_moe.FAMILY,
                                gemma3.FAMILY)


def family_named(name: str) -> Family:
    """The family called `name` (`decode-worker demo --family`). Raises ConfigError."""
    for family in FAMILIES:
        if family.name == name or name in family.model_types:
            return family
    raise ConfigError(f"unknown model family {name!r}; supported: "
                      f"{', '.join(f.name for f in FAMILIES)}")


def family_of(raw: dict[str, Any], source: str = "config.json") -> Family:
    """The family of a parsed config.json: by `architectures` when it names any, else by
    `model_type`. Raises ConfigError in one line naming both and the supported list."""
    archs = raw.get("architectures") or []
    model_type = raw.get("model_type")
    if isinstance(archs, list) and archs:
        for family in FAMILIES:
            if any(a in family.architectures for a in archs):
                return family
    else:
        for family in FAMILIES:
            if model_type in family.model_types:
                return family
    supported = "; ".join(f"{', '.join(f.architectures)} ({', '.join(f.model_types)})"
                          for f in FAMILIES)
    raise ConfigError(f"{source}: architectures={archs!r} model_type={model_type!r} is not "
                      f"supported; supported: {supported}")


def read_json(path: Path) -> dict[str, Any]:
    """A config.json as a dict; ConfigError for a missing or unreadable file."""
    try:
        raw = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: cannot read model config: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: a model config must be a JSON object")
    return raw


def read_model_config(model_dir: Path) -> tuple[Family, ArchFacts]:
    """The family and architecture facts of a local Hugging Face directory. Raises
    ConfigError (unsupported architecture, a missing or invalid field, named)."""
    path = Path(model_dir) / "config.json"
    raw = read_json(path)
    family = family_of(raw, str(path))
    return family, family.read_config(raw, str(path))


def load_model(model_dir: Path, device: torch.device | str, dtype: torch.dtype = torch.float32,
               *, moe_backend: str = "torch") -> CausalLM:
    """config.json + safetensors -> the family's model on `device` in `dtype`. Raises
    ConfigError for an unsupported architecture, a bad field, a missing tensor or a tensor
    whose shape does not match its config (naming the tensor and both shapes)."""
    from decode_worker.device.model.weights import load_model as load_gpt_oss

    family, cfg = read_model_config(model_dir)
    if not isinstance(cfg, ModelConfig):  # gpt-oss keeps its own loader
        return load_gpt_oss(model_dir, device, dtype, moe_backend=moe_backend)
    ckpt = Checkpoint(Path(model_dir), cfg.fp8_block)
    model = load_decoder(cfg, ckpt, torch.device(device), dtype, moe_backend=moe_backend)
    log.info("loaded %s from %s: %d layers (%d sliding, window %d), dtype %s, device %s%s",
             family.name, model_dir, cfg.num_hidden_layers, len(cfg.sliding_layers), cfg.window,
             dtype, device, ", FP8 weights dequantized at load" if cfg.fp8_block else "")
    return model
