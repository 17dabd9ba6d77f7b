"""The prefill "forward" of one rank: what it writes into SGLang's pools and metadata row.

Two kinds (`kv` in POST /prefill), each filling the rank's `SWAKVPool` at the token slots SGLang's
allocator gave and returning the fields `MetadataBuffers.set_buf` reads:
  - "seeded" (default): `kv_bits(seed, ...)` for every position, aux fields as the request gives
    them (`first_token`, `logprob`, `top_logprobs`, `cached_tokens`);
  - "model": the real prefill of a Hugging Face directory (`--model DIR`), computed with
    transformers on the request's `input_ids`: the post-RoPE K and V of every layer (what the
    attention caches, and what decode-worker's pools hold), this rank's head slice; the first
    output token is the greedy argmax of the last position's logits, its logprob (and the top
    `top_logprobs_num` alternatives, when `return_logprob`) the float32 log_softmax of the raw
    logits, as SGLang's prefill puts them into the metadata row.

Full-attention layers get every position of [0, L); sliding-window layers only SGLang's SWA
window [swa_start, L) (the SWA pool holds nothing below it). Venv-only (torch, transformers).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from layout import Layout, kv_bits, model_geometry

_SIGNED = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}


@dataclass(frozen=True)
class Slots:
    """Token slots of one room in the rank's pools (`req_to_token` rows).

    full: [L] i32 over [0, L); swa: [L] i32, -1 below `swa_start` (SGLang's window start,
    floored to a page).
    """

    full: torch.Tensor
    swa: torch.Tensor
    swa_start: int


def _layer_slots(layout: Layout, slots: Slots, layer: int) -> tuple[int, torch.Tensor]:
    """(first position written, int64 slots of [first, L)) of one model layer."""
    if layer in layout.sliding_layer_ids:
        return slots.swa_start, slots.swa[slots.swa_start:].long()
    return 0, slots.full.long()


def write_seeded(pool: Any, layout: Layout, heads: np.ndarray, seed: int,
                 slots: Slots) -> None:
    """`kv_bits` of every written position and this rank's global KV `heads`."""
    seq_len = len(slots.full)
    for layer in range(layout.num_layers):
        first, where = _layer_slots(layout, slots, layer)
        positions = np.arange(first, seq_len)
        for kind, buf in ((0, pool.get_key_buffer(layer)), (1, pool.get_value_buffer(layer))):
            bits = kv_bits(seed, layer, kind, positions, heads, layout.head_dim,
                           buf.element_size())
            # buf: [pool_tokens + ps, heads_per_rank, head_dim]
            buf[where] = torch.from_numpy(bits.view(_SIGNED[bits.itemsize])).view(buf.dtype)


def seeded_aux(spec: dict[str, Any]) -> dict[str, Any]:
    """The metadata-row fields of a seeded room, as the request states them."""
    return {"first_token": int(spec.get("first_token", 0)),
            "cached_tokens": int(spec.get("cached_tokens", 0)),
            "logprob": spec.get("logprob"),
            "top_logprobs": [tuple(x) for x in spec.get("top_logprobs") or []]}


@dataclass(frozen=True)
class PrefillResult:
    """One prompt's real prefill. keys/values: per model layer [L, kv_heads, head_dim], post-RoPE,
    in the model dtype; logprobs: [V] f32 log_softmax of the last position's raw logits."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    logprobs: torch.Tensor

    @property
    def first_token(self) -> int:
        return int(self.logprobs.argmax())


class ModelForward:
    """transformers' model of the directory (GptOssForCausalLM, Qwen3ForCausalLM, ...) on the
    CPU, one prompt at a time (a lock serializes the
    room threads, as one scheduler runs one forward at a time)."""

    def __init__(self, model_dir: str, layout: Layout) -> None:
        from transformers import AutoModelForCausalLM

        want = model_geometry(model_dir)
        have = {k: getattr(layout, k) for k in want}
        if have != want:
            raise SystemExit(f"--model {model_dir}: the layout {have} is not the model's {want}")
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=layout.torch_dtype())
        self.model.eval()
        self.dtype = next(self.model.parameters()).dtype
        if self.dtype != layout.torch_dtype():
            raise SystemExit(f"--model {model_dir}: weights are {self.dtype}, the KV pools "
                             f"{layout.dtype}: they must be equal (config dtype)")
        self.vocab_size = int(self.model.config.vocab_size)
        self.lock = threading.Lock()

    @torch.no_grad()
    def run(self, input_ids: list[int]) -> PrefillResult:
        """The prompt's prefill with a plain (all-positions) cache: every layer keeps [0, L)."""
        from transformers import DynamicCache

        if min(input_ids) < 0 or max(input_ids) >= self.vocab_size:
            raise ValueError(f"input_ids must lie in [0, {self.vocab_size})")
        ids = torch.tensor([input_ids], dtype=torch.long)  # [1, L]
        with self.lock:
            out = self.model(input_ids=ids, past_key_values=DynamicCache(), use_cache=True)
        layers = out.past_key_values.layers  # keys/values: [1, kv_heads, L, head_dim]
        keys = [layer.keys[0].transpose(0, 1).contiguous() for layer in layers]
        values = [layer.values[0].transpose(0, 1).contiguous() for layer in layers]
        logprobs = torch.log_softmax(out.logits[0, -1].float(), dim=-1)  # [V] f32
        return PrefillResult(keys, values, logprobs)

    def fill(self, pool: Any, layout: Layout, heads: np.ndarray, slots: Slots,
             input_ids: list[int], spec: dict[str, Any]) -> dict[str, Any]:
        """Write this rank's heads of the real K/V; return the metadata-row fields."""
        result = self.run(input_ids)
        head_ids = torch.from_numpy(heads).long()
        for layer in range(layout.num_layers):
            first, where = _layer_slots(layout, slots, layer)
            for src, buf in ((result.keys[layer], pool.get_key_buffer(layer)),
                             (result.values[layer], pool.get_value_buffer(layer))):
                if buf.dtype != src.dtype:
                    raise RuntimeError(f"pool dtype {buf.dtype} != model KV dtype {src.dtype}")
                buf[where] = src[first:, head_ids]  # [L - first, heads_per_rank, head_dim]
        return model_aux(result, spec)


def model_aux(result: PrefillResult, spec: dict[str, Any]) -> dict[str, Any]:
    """First token, and with `return_logprob` its logprob and `top_logprobs_num` alternatives."""
    token = result.first_token
    aux: dict[str, Any] = {"first_token": token, "cached_tokens": int(spec.get("cached_tokens", 0)),
                           "logprob": None, "top_logprobs": []}
    if spec.get("return_logprob"):
        aux["logprob"] = float(result.logprobs[token])
        num = int(spec.get("top_logprobs_num") or 0)
        if num > 0:
            vals, idx = result.logprobs.topk(num)
            aux["top_logprobs"] = list(zip(idx.tolist(), vals.tolist(), strict=True))
    return aux
