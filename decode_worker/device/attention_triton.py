"""Decode attention through the Triton kernels (device/kernels/decode_attention.py): the
`Attend` of a decode step on CUDA (`model.attention_backend`, device/attention_backend.py).

Same contract as `DecodeAttention` (device/attention.py, the reference): one new token per
request, its K/V written into its page first, then attention over [0, pos] (full layers) or
[pos - window, pos] (SWA layers, through the ring table). Unlike the torch path nothing here
depends on the table width: the kernels read each request's key count from `positions` on the
device, so a CUDA graph captured with the widest table serves every context length.
"""

from __future__ import annotations

import functools

import torch

from decode_worker.device.kernels.decode_attention import (
    BLOCK_N,
    NO_WINDOW,
    paged_decode,
    partials,
    write_kv,
)
from decode_worker.device.kv_pool import KVPools
from decode_worker.utils.mathx import cdiv

MAX_SPLITS = 32  # split-K parts of a full layer's keys (bs 1 on a 132-SM H200: 8 x 32 programs)
PROGRAMS_PER_SM = 4  # stage-1 programs per SM a split count aims for


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # the interpreter (tests): few programs run fastest
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def num_kv_splits(batch_size: int, kv_heads: int, max_keys: int, device: torch.device) -> int:
    """Splits of a layer's key range for a batch of `batch_size` (a graph's bucket): enough
    stage-1 programs (batch x kv heads x splits) for PROGRAMS_PER_SM on each SM, at most
    MAX_SPLITS and at most one per BLOCK_N of `max_keys` (the most keys a request can have).
    Depends only on its arguments, so a graph bucket has one split count."""
    want = cdiv(PROGRAMS_PER_SM * _num_sms(device), batch_size * kv_heads)
    return max(1, min(want, MAX_SPLITS, cdiv(max_keys, BLOCK_N)))


class TritonDecodeAttention:
    """One decode step for `bs` requests over the pools, every layer through the kernels.

    Built once per step (inside the graph when captured); holds the step's tables and the
    stage-1 scratch shared by the layers of one pool.
    """

    def __init__(self, pools: KVPools, window: int, positions: torch.Tensor,
                 full_table: torch.Tensor, swa_table: torch.Tensor, max_keys: int,
                 scale: float | None = None) -> None:
        """positions: [bs] i64; full_table: [bs, W] (page of p at column p // page_size,
        covering each request's position; wider is fine); swa_table: [bs, ring] (column
        (p // page_size) % ring); `window`: earlier tokens a sliding query sees (HF
        `sliding_window - 1`); `max_keys`: the most keys a full-layer request can have (sets
        the split count with the batch size); `scale`: the softmax scale (default
        head_dim ** -0.5)."""
        self.pools, self.positions = pools, positions
        self.tables = {"full": full_table, "swa": swa_table}
        self.windows = {"full": NO_WINDOW, "swa": window}
        bs, dev = positions.shape[0], positions.device
        spec = pools.spec
        self.splits = {
            "full": num_kv_splits(bs, spec.shape("full").num_kv_heads, max_keys, dev),
            "swa": num_kv_splits(bs, spec.shape("swa").num_kv_heads, min(max_keys, window + 1),
                                 dev)}
        self.scratch: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.scale = scale or spec.head_dim ** -0.5

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 sinks: torch.Tensor) -> torch.Tensor:
        """q: [bs, heads, hd]; k, v: [bs, kvh, hd] -> [bs, heads * hd]. Writes k/v first."""
        pool, _ = self.pools.layer_slot(layer)
        kv = self.pools.layer_tensor(layer)  # [N + 1, 2, ps, kvh, hd]
        table = self.tables[pool]
        write_kv(kv, k, v, table, self.positions)
        scratch = self.scratch.get(pool)
        if scratch is None:  # the first layer of this pool allocates, the others reuse
            bs, heads, hd = q.shape
            scratch = partials(bs, heads, hd, self.splits[pool], q.device)
            self.scratch[pool] = scratch
        return paged_decode(q, kv, table, self.positions, sinks, self.windows[pool],
                            self.scale, scratch)
