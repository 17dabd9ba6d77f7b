"""Reading a checkpoint's tensors: one or many safetensors files (sharded with
`model.safetensors.index.json`, or every `*.safetensors` in the directory), bf16 / fp16 / fp32,
and FP8 block-quantized weights as Qwen3-*-FP8 and DeepSeek ship them.

FP8 (`quantization_config.quant_method` "fp8", `weight_block_size` [bn, bk]): a quantized
Linear weight [N, K] is float8_e4m3fn with `<name>_scale_inv` [cdiv(N, bn), cdiv(K, bk)] f32,
and its value is `weight * scale_inv[n // bn, k // bk]`. It is dequantized here, on the CPU, to
the model dtype (the CUDA path that would keep FP8 with a block-scaled GEMM is not built: no GPU
was lent to measure it).

A tensor is read only when asked for (`get`), so a model loads one tensor at a time; `get`
checks its shape against what the config implies and raises ConfigError naming the tensor and
both shapes.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from decode_worker.errors import ConfigError
from decode_worker.utils.mathx import cdiv

INDEX = "model.safetensors.index.json"


class Checkpoint:
    """Tensor names -> the file that holds them; tensors are read on demand."""

    def __init__(self, model_dir: Path, fp8_block: tuple[int, int] | None = None) -> None:
        """Raises ConfigError without safetensors files or with a broken index."""
        self.model_dir = Path(model_dir)
        self.fp8_block = fp8_block
        self.files: dict[str, Path] = {}
        index = self.model_dir / INDEX
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise ConfigError(f"{index}: unusable index: {exc!r}") from None
            self.files = {str(k): self.model_dir / str(v) for k, v in weight_map.items()}
            missing = {p for p in self.files.values() if not p.is_file()}
            if missing:
                raise ConfigError(f"{index}: shard {sorted(missing)[0].name} is missing")
        else:
            for path in sorted(self.model_dir.glob("*.safetensors")):
                with safe_open(str(path), framework="pt") as sf:
                    self.files.update(dict.fromkeys(sf.keys(), path))
        if not self.files:
            raise ConfigError(f"{self.model_dir}: no *.safetensors files")

    def __contains__(self, name: object) -> bool:
        return name in self.files

    def names(self) -> list[str]:
        return list(self.files)

    def raw(self, name: str) -> torch.Tensor:
        """The tensor as stored (CPU). Raises ConfigError when the checkpoint lacks it."""
        path = self.files.get(name)
        if path is None:
            raise ConfigError(f"checkpoint lacks tensor {name!r}")
        with safe_open(str(path), framework="pt") as sf:
            return sf.get_tensor(name)

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype,
            device: torch.device) -> torch.Tensor:
        """Tensor `name` in `dtype` on `device`, FP8 weights dequantized first. Raises
        ConfigError for a missing tensor or a shape other than `shape`."""
        t = self.raw(name)
        if tuple(t.shape) != shape:
            raise ConfigError(f"tensor {name!r} has shape {tuple(t.shape)}, config implies "
                              f"{shape}")
        if t.dtype == torch.float8_e4m3fn:
            t = self._dequantize(name, t)
        return t.to(device=device, dtype=dtype)

    def _dequantize(self, name: str, w: torch.Tensor) -> torch.Tensor:
        scale_name = name + "_scale_inv"
        if self.fp8_block is None or scale_name not in self.files:
            raise ConfigError(f"tensor {name!r} is float8_e4m3fn but the config has no fp8 "
                              f"weight_block_size or the checkpoint no {scale_name!r}")
        return dequantize_fp8_block(w, self.raw(scale_name), self.fp8_block, scale_name)


def dequantize_fp8_block(w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                         name: str = "weight_scale_inv") -> torch.Tensor:
    """w [N, K] float8_e4m3fn, scale_inv [cdiv(N, bn), cdiv(K, bk)] -> [N, K] float32 with
    value `w[n, k] * scale_inv[n // bn, k // bk]`. Raises ConfigError for a scale of the wrong
    shape (naming it and both shapes)."""
    n, k = w.shape
    bn, bk = block
    want = (cdiv(n, bn), cdiv(k, bk))
    if tuple(scale_inv.shape) != want:
        raise ConfigError(f"tensor {name!r} has shape {tuple(scale_inv.shape)}, weight "
                          f"{tuple(w.shape)} with blocks {list(block)} implies {want}")
    s = scale_inv.float().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]  # [N, K]
    return w.float() * s
