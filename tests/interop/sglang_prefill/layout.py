"""The model geometry and the synthetic KV of the SGLang interop rig (numpy and json only).

`kv_bits` is the contract with any test that checks landed KV bytes (README.md in this
directory states it in words). This module imports no SGLang, torch or NIXL, so a test in
another environment can reuse it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Layout:
    """A model's KV geometry, as one prefill or decode rank sees it: a gpt-oss-style hybrid
    (full and sliding layers), or an ordinary model (no sliding layers: one MHA pool).

    `sliding_window_hf` is Hugging Face's `sliding_window` (128 for gpt-oss): a token sees itself
    and the 127 before it, so SGLang's window (`swa_window`) is `sliding_window_hf - 1`.
    """

    num_layers: int = 4
    sliding_layer_ids: tuple[int, ...] = (0, 2)
    kv_heads: int = 2  # total, over all attention TP ranks
    head_dim: int = 16
    dtype: str = "bfloat16"
    page_size: int = 16
    sliding_window_hf: int = 128
    tp_size: int = 1
    pool_tokens: int = 4096
    swa_pool_tokens: int = 4096
    metadata_rows: int = 16

    @property
    def full_layer_ids(self) -> list[int]:
        return [i for i in range(self.num_layers) if i not in self.sliding_layer_ids]

    @property
    def heads_per_rank(self) -> int:
        return self.kv_heads // self.tp_size

    @property
    def swa_window(self) -> int:
        return self.sliding_window_hf - 1

    def torch_dtype(self) -> Any:
        import torch

        return getattr(torch, self.dtype)

    def as_dict(self) -> dict[str, Any]:
        return {
            "num_layers": self.num_layers,
            "sliding_layer_ids": list(self.sliding_layer_ids),
            "full_layer_ids": self.full_layer_ids,
            "kv_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "dtype": self.dtype,
            "page_size": self.page_size,
            "sliding_window_hf": self.sliding_window_hf,
            "swa_window": self.swa_window,
            "tp_size": self.tp_size,
            "pool_tokens": self.pool_tokens,
            "swa_pool_tokens": self.swa_pool_tokens,
            "metadata_rows": self.metadata_rows,
        }


def add_layout_args(parser: Any) -> None:
    d = Layout()
    parser.add_argument("--num-layers", type=int, default=d.num_layers)
    parser.add_argument(
        "--sliding-layers", default="even",
        help="comma list of sliding-window layer ids, or 'even' (gpt-oss: 0, 2, 4, ...)",
    )
    parser.add_argument("--kv-heads", type=int, default=d.kv_heads, help="total KV heads")
    parser.add_argument("--head-dim", type=int, default=d.head_dim)
    parser.add_argument("--dtype", default=d.dtype, help="torch dtype name of the KV pools")
    parser.add_argument("--page-size", type=int, default=d.page_size)
    parser.add_argument("--sliding-window", type=int, default=d.sliding_window_hf,
                        help="Hugging Face sliding_window (SGLang's window is one less)")
    parser.add_argument("--tp-size", type=int, default=1, help="prefill attention TP ranks")
    parser.add_argument("--pool-tokens", type=int, default=d.pool_tokens)
    parser.add_argument("--swa-pool-tokens", type=int, default=d.swa_pool_tokens)
    parser.add_argument("--metadata-rows", type=int, default=d.metadata_rows)
    parser.add_argument(
        "--model", default=None,
        help="Hugging Face gpt-oss directory: enables `kv: model` rooms; the geometry flags "
             "then come from its config.json (a flag set to another value is refused)",
    )


def layout_from_args(args: Any) -> Layout:
    if args.sliding_layers == "even":
        sliding = tuple(range(0, args.num_layers, 2))
    else:
        sliding = tuple(int(x) for x in args.sliding_layers.split(",") if x.strip())
    layout = Layout(
        num_layers=args.num_layers, sliding_layer_ids=sliding, kv_heads=args.kv_heads,
        head_dim=args.head_dim, dtype=args.dtype, page_size=args.page_size,
        sliding_window_hf=args.sliding_window, tp_size=args.tp_size,
        pool_tokens=args.pool_tokens, swa_pool_tokens=args.swa_pool_tokens,
        metadata_rows=args.metadata_rows,
    )
    if getattr(args, "model", None):
        layout = _with_model_geometry(layout, args.model)
    if layout.kv_heads % layout.tp_size:
        raise SystemExit(f"--kv-heads {layout.kv_heads} must divide by --tp-size {layout.tp_size}")
    if not layout.full_layer_ids:
        raise SystemExit("need at least one full-attention layer")
    return layout


# the model types SGLang 0.5.23 lays out with SWA pools (`is_hybrid_swa_model`, of those this
# rig runs); every other model is an ordinary one there: full KV in every layer, the window
# (Gemma 2/3, Mistral) only an attention mask
HYBRID_SWA_TYPES = ("gpt_oss",)


def model_geometry(model_dir: str) -> dict[str, Any]:
    """The Layout fields a Hugging Face directory's config.json fixes, as SGLang lays the
    model out: sliding layers only for a hybrid-SWA model (gpt-oss); an ordinary model (Llama,
    Qwen3, Gemma 3) is all full layers (no SWA pool)."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    hybrid = cfg.get("model_type") in HYBRID_SWA_TYPES
    types = (cfg.get("layer_types") or []) if hybrid else []
    heads = int(cfg["num_attention_heads"])
    return {"num_layers": int(cfg["num_hidden_layers"]),
            "sliding_layer_ids": tuple(i for i, t in enumerate(types) if t == "sliding_attention"),
            "kv_heads": int(cfg.get("num_key_value_heads") or heads),
            "head_dim": int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads),
            "sliding_window_hf": int(cfg.get("sliding_window") or 128) if hybrid else 128,
            "dtype": str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32")}


def _with_model_geometry(layout: Layout, model_dir: str) -> Layout:
    """`layout` with the model's geometry; a flag that differs from both the default and the
    model is refused (the pools must hold exactly the model's KV: heads, head_dim, dtype)."""
    default, model = Layout(), model_geometry(model_dir)
    for key, value in model.items():
        given = getattr(layout, key)
        if given != getattr(default, key) and given != value:
            raise SystemExit(f"--model {model_dir}: {key} is {value!r} in its config.json, "
                             f"the flags say {given!r}")
    return replace(layout, **model)


# ---- the synthetic KV contract ------------------------------------------------------------
_MIX = (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB, 0xD6E8FEB86659FD93,
        0xA0761D6478BD642F, 0xE7037ED1A0B428DB)


def kv_bits(seed: int, layer: int, kind: int, positions: np.ndarray, heads: np.ndarray,
            head_dim: int, itemsize: int) -> np.ndarray:
    """Bit patterns of K (kind 0) or V (kind 1) of model layer `layer`.

    Returns an unsigned array [len(positions), len(heads), head_dim] of `itemsize` bytes per
    element; view it as the pool dtype. `heads` are global KV head ids (over all TP ranks).
    The second-highest bit is cleared so every value is a finite float in any float format.
    """
    u64 = np.uint64
    pos = positions.astype(u64)[:, None, None]
    head = heads.astype(u64)[None, :, None]
    dim = np.arange(head_dim, dtype=u64)[None, None, :]
    with np.errstate(over="ignore"):
        x = (u64(seed) * u64(_MIX[0]) + u64(layer) * u64(_MIX[1]) + u64(kind) * u64(_MIX[5])
             + pos * u64(_MIX[2]) + head * u64(_MIX[3]) + dim * u64(_MIX[4]))
        x = x ^ (x >> u64(31))
        x = x * u64(0x9FB21C651E98DF25)
        x = x ^ (x >> u64(29))
    bits = 8 * itemsize
    mask = ((1 << bits) - 1) & ~(1 << (bits - 2))
    out = x & u64(mask)
    return out.astype({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[itemsize])
