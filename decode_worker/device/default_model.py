"""The embedded default model: a tiny gpt-oss with seeded random weights and a byte tokenizer.

4 layers (sliding, full, sliding, full), HF sliding_window 128 (window 127), hidden 64, 4 heads
over 2 KV heads of 16, 4 experts with top-2, YaRN RoPE as gpt-oss ships it, float32. Every tensor
is drawn from N(0, 0.02) (RMSNorm weights 1 + N(0, 0.02); biases and sinks random too, so the
oracle exercises them). The tokenizer maps byte b to id b (GPT-2 byte-to-unicode alphabet, no
merges) plus gpt-oss's harmony special tokens (`<|endoftext|>` 256, `<|start|>` 257,
`<|message|>` 258, `<|end|>` 259, `<|channel|>` 260, `<|constrain|>` 261, `<|return|>` 262,
`<|call|>` 263), so any text round-trips and any output decodes to text. Its chat template
renders the harmony format (`harmony_template.py`); as gpt-oss's generation config does,
`<|return|>`, `<|endoftext|>` and `<|call|>` end generation.

Written with `safetensors` and `tokenizers` only; `transformers` loads the directory with
`GptOssForCausalLM.from_pretrained(dir)`. `decode-worker make-model DIR` calls `run`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from decode_worker.device.harmony_template import HARMONY_CHAT_TEMPLATE

FORMAT_VERSION = 2  # 2: harmony special tokens and chat template (the cache dir changes name)
SPECIAL_TOKENS = ("<|endoftext|>", "<|start|>", "<|message|>", "<|end|>", "<|channel|>",
                  "<|constrain|>", "<|return|>", "<|call|>")
EOS_TOKEN_ID = 256  # <|endoftext|>: config.json's eos and the pad token
RETURN_TOKEN_ID, CALL_TOKEN_ID = 262, 263  # <|return|>, <|call|>
EOS_TOKEN_IDS = (RETURN_TOKEN_ID, EOS_TOKEN_ID, CALL_TOKEN_ID)  # generation_config, gpt-oss order
VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)
INIT_STD = 0.02


def tiny_config(**overrides: Any) -> dict[str, Any]:
    """The config.json content (transformers' GptOssConfig field names)."""
    cfg: dict[str, Any] = {
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
        "vocab_size": VOCAB_SIZE, "hidden_size": 64, "intermediate_size": 64,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2,
        "sliding_window": 128, "layer_types": ["sliding_attention", "full_attention"] * 2,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "attention_bias": True,
        "swiglu_alpha": 1.702, "swiglu_limit": 7.0, "initializer_range": INIT_STD,
        "rope_parameters": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                            "beta_slow": 1.0, "truncate": False, "rope_theta": 150000.0,
                            "original_max_position_embeddings": 4096},
        "tie_word_embeddings": False, "eos_token_id": EOS_TOKEN_ID, "pad_token_id": None,
        "bos_token_id": None, "hidden_act": "silu", "dtype": "float32", "use_cache": True,
    }
    cfg.update(overrides)
    if "num_hidden_layers" in overrides and "layer_types" not in overrides:
        n = cfg["num_hidden_layers"]
        cfg["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention"
                              for i in range(n)]
    return cfg


def random_state_dict(cfg: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """HF-named float32 tensors drawn in a fixed order from one seeded generator."""
    gen = torch.Generator().manual_seed(seed)
    h, inter, e = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_local_experts"]
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg["vocab_size"], h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (nh * hd, h), p + "self_attn.q_proj.bias": (nh * hd,),
            p + "self_attn.k_proj.weight": (nkv * hd, h), p + "self_attn.k_proj.bias": (nkv * hd,),
            p + "self_attn.v_proj.weight": (nkv * hd, h), p + "self_attn.v_proj.bias": (nkv * hd,),
            p + "self_attn.o_proj.weight": (h, nh * hd), p + "self_attn.o_proj.bias": (h,),
            p + "self_attn.sinks": (nh,),
            p + "mlp.router.weight": (e, h), p + "mlp.router.bias": (e,),
            p + "mlp.experts.gate_up_proj": (e, h, 2 * inter),
            p + "mlp.experts.gate_up_proj_bias": (e, 2 * inter),
            p + "mlp.experts.down_proj": (e, inter, h),
            p + "mlp.experts.down_proj_bias": (e, h),
        })
    shapes["model.norm.weight"] = (h,)
    shapes["lm_head.weight"] = (cfg["vocab_size"], h)
    state = {}
    for name, shape in shapes.items():
        t = torch.randn(shape, generator=gen) * INIT_STD  # [shape] f32
        state[name] = t + 1.0 if name.endswith("norm.weight") else t
    return state


def byte_tokenizer(specials: tuple[str, ...] = SPECIAL_TOKENS,
                   plain: tuple[str, ...] = ()) -> HFTokenizer:
    """Byte-level tokenizer: byte b -> id b, then the added tokens 256, 257, ... (gpt-oss's
    harmony tokens unless `specials` names others); those in `plain` are added tokens that are
    not special (kept by skip_special_tokens, as Qwen3's `<think>` is)."""
    alphabet = _bytes_to_unicode()
    vocab = {alphabet[b]: b for b in range(256)}
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False)
                            for s in specials if s not in plain])
    tok.add_tokens([AddedToken(s, special=False, normalized=False)
                    for s in specials if s in plain])
    return tok


def write_model(out_dir: Path, seed: int = 0, **overrides: Any) -> Path:
    """Write config.json, generation_config.json, model.safetensors, tokenizer.json and
    tokenizer_config.json into `out_dir` (created if needed; files overwritten)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = tiny_config(**overrides)
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    gen_cfg = {"eos_token_id": list(EOS_TOKEN_IDS), "do_sample": False}
    (out_dir / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2) + "\n")
    save_file(random_state_dict(cfg, seed), str(out_dir / "model.safetensors"),
              metadata={"format": "pt"})  # one key: header bytes stay stable
    byte_tokenizer().save(str(out_dir / "tokenizer.json"))
    tok_cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": SPECIAL_TOKENS[0],
               "pad_token": SPECIAL_TOKENS[0], "chat_template": HARMONY_CHAT_TEMPLATE,
               "model_max_length": cfg["max_position_embeddings"]}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    return out_dir


def ensure_default_model(cache_dir: Path, seed: int = 0) -> Path:
    """The default model's directory under `cache_dir`, written once.

    Idempotent and safe when processes race: each writes a private temp dir and renames it into
    place; the loser of the rename discards its copy.
    """
    final = Path(cache_dir) / f"tiny-gpt-oss-v{FORMAT_VERSION}-seed{seed}"
    return write_once(final, lambda tmp: write_model(tmp, seed))


def write_once(final: Path, write: Callable[[Path], object]) -> Path:
    """`final`, a model directory, written once by `write(dir)` unless it holds a model:
    each process writes a private temp dir beside it and renames it into place; the loser of
    the rename discards its copy."""
    if (final / "model.safetensors").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=final.parent))
    try:
        write(tmp)
        os.rename(tmp, final)
    except OSError:
        if not (final / "model.safetensors").is_file():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def run(args: argparse.Namespace, loaded: Any) -> int:
    """`decode-worker make-model DIR`: write the default model (seed = model.seed) to DIR."""
    seed = int(loaded.settings.model.seed)
    path = write_model(Path(args.dir), seed)
    print(f"wrote tiny gpt-oss (seed {seed}) to {path}")
    return 0


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode character map (the ByteLevel alphabet)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping
