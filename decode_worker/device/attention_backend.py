"""Which decode attention a runner uses: the Triton kernel over the pools, or the torch path.

`model.attention_backend`: `auto` (Triton on CUDA when triton imports, torch elsewhere),
`triton` (refused at start-up without CUDA or without triton), `torch` (device/attention.py:
the CPU implementation and the reference the kernel is tested against). Prefill attention is
torch either way.

Importing this module never imports triton (device/attention_triton.py does), so on CPU the
torch path never loads it, and under tests the interpreter switch `TRITON_INTERPRET` is read
first.
"""

from __future__ import annotations

import functools
import importlib
from typing import Literal

import torch

from decode_worker.device.attention import DecodeAttention
from decode_worker.device.kv_pool import KVPools
from decode_worker.device.model.gpt_oss import Attend
from decode_worker.device.query_groups import QueryGroups
from decode_worker.errors import ConfigError

AttentionBackend = Literal["triton", "torch"]
SETTING = "model.attention_backend"


@functools.cache
def triton_import_error() -> str | None:
    """Why `import triton` fails here, or None when it works."""
    try:
        importlib.import_module("triton")
    except ImportError as exc:
        return str(exc)
    return None


def resolve_attention_backend(setting: str, device: torch.device) -> AttentionBackend:
    """The backend `setting` (auto | triton | torch) means on `device`. Raises ConfigError
    naming the setting for `triton` without a CUDA device or without an importable triton."""
    return resolve_backend(SETTING, setting, device)


def resolve_backend(name: str, setting: str, device: torch.device) -> AttentionBackend:
    """What the kernel setting `name` (model.attention_backend, model.moe_backend), set to
    `setting`, means on `device`: auto = triton on CUDA when triton imports, else torch.
    Raises ConfigError naming `name` for `triton` without CUDA or without triton."""
    if setting == "torch":
        return "torch"
    cuda = device.type == "cuda"
    if setting == "auto":
        return "triton" if cuda and triton_import_error() is None else "torch"
    if setting != "triton":
        raise ConfigError(f"{name}={setting!r}: expected 'auto', 'triton' or 'torch'")
    if not cuda:
        raise ConfigError(f"{name}='triton' needs a CUDA device (the model runs on "
                          f"{device.type}); use 'auto' or 'torch'")
    error = triton_import_error()
    if error is not None:
        raise ConfigError(f"{name}='triton': triton does not import ({error}); install "
                          "triton or use 'auto' or 'torch'")
    return "triton"


def decode_attention(backend: AttentionBackend, pools: KVPools, window: int,
                     positions: torch.Tensor, full_table: torch.Tensor, swa_table: torch.Tensor,
                     *, max_keys: int, scale: float | None = None,
                     groups: QueryGroups | None = None) -> Attend:
    """The `Attend` of one decode step (arguments as `DecodeAttention`'s; `max_keys`: the
    most keys a request can have, which bounds the Triton backend's split count; `groups`: a
    verify step's groups of entries, whose keys both backends read once per group)."""
    if backend == "torch":
        return DecodeAttention(pools, window, positions, full_table, swa_table, scale, groups)
    # imported here: triton loads only for a runner that uses it (after TRITON_INTERPRET)
    from decode_worker.device.attention_triton import TritonDecodeAttention

    return TritonDecodeAttention(pools, window, positions, full_table, swa_table, max_keys,
                                 scale, groups)
