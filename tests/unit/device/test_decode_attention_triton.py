"""The Triton paged decode attention equals the torch path (device/attention.py, the reference).

On CPU the kernels run under Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1
before triton loads), so shapes are small: head_dim 64, one or two KV heads, contexts of a few
hundred tokens. tests/gpu/test_decode_attention_cuda.py runs the same cases compiled.

Every pool holds random values (never zeros) and every table entry a request must not read holds
a real, random page, so a wrong page, slot, window edge or ring column changes the output.

Tolerances (|triton - torch| <= ATOL + RTOL * |torch|):
- float32 pools: both compute in IEEE float32 and differ only in summation order (split-K
  blocks vs one pass): 1e-5 (seen: 7e-7).
- bfloat16 pools: q, K and V are bf16 in both, scores are float32 in both; the kernel rounds the
  softmax weights to bf16 for its P @ V dot (relative 2^-9 each, as SGLang's kernel does) and
  both round the output to bf16 (2^-9 relative): one bf16 ulp at |out| ~ 2 is 2^-7, so
  ATOL = RTOL = 1e-2 (seen: 0.0156, one ulp at |out| in [2, 4), where the bound is >= 0.03).
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pytest
import torch

from decode_worker.device.attention import DecodeAttention
from decode_worker.device.attention_triton import (
    MAX_SPLITS,
    TritonDecodeAttention,
    num_kv_splits,
)
from decode_worker.device.decode_inputs import swa_ring_width
from decode_worker.device.kernels.decode_attention import (
    NO_WINDOW,
    paged_decode,
    partials,
    write_kv,
)
from decode_worker.device.kv_pool import KVPools, KVSpec

if TYPE_CHECKING:
    from tests.unit.device.conftest import Runs

WINDOW = 127  # gpt-oss: HF sliding_window 128
HEAD_DIM = 64
NUM_PAGES = 96  # per pool
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1e-2, 1e-2)}  # (atol, rtol), see above
# on CPU tensors the kernels run only interpreted (a CUDA machine runs tests/gpu instead)
interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="CPU tensors need TRITON_INTERPRET=1; see tests/gpu")


@dataclass
class Case:
    pools: KVPools
    positions: torch.Tensor  # [bs] i64
    full: torch.Tensor  # [bs, W] i32, W wider than any request needs
    swa: torch.Tensor  # [bs, ring] i32
    q: torch.Tensor  # [bs, heads, hd]
    k: torch.Tensor  # [bs, kvh, hd]
    v: torch.Tensor  # [bs, kvh, hd]
    sinks: torch.Tensor  # [heads] f32


def make_case(positions: list[int], page_size: int, kv_heads: int, group: int,
              dtype: torch.dtype, device: str = "cpu", seed: int = 0,
              q_dtype: torch.dtype | None = None, num_pages: int = NUM_PAGES) -> Case:
    """A batch at `positions` over one full and one sliding layer (`num_pages` pages each),
    pages drawn at random."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    spec = KVSpec(("full_attention", "sliding_attention"), kv_heads, HEAD_DIM)
    pools = KVPools(spec, num_pages, num_pages, page_size, device, dtype)
    for t in (pools.full, pools.swa):
        t.copy_(torch.randn(t.shape, generator=gen).to(dtype))  # page 0 too: never read
    bs, ring = len(positions), swa_ring_width(WINDOW, page_size)
    width = max(positions) // page_size + 3  # wider than needed, like a graph's table
    full = torch.tensor([rng.sample(range(1, num_pages + 1), width) for _ in positions])
    swa = torch.tensor([rng.sample(range(1, num_pages + 1), ring) for _ in positions])
    # requests may share pages they read, never the page their new token goes to
    for table, cols in ((full, [p // page_size for p in positions]),
                        (swa, [p // page_size % ring for p in positions])):
        table[range(bs), cols] = torch.tensor(rng.sample(range(1, num_pages + 1), bs))
    heads = kv_heads * group
    qd = q_dtype or dtype
    sinks = torch.randn(heads, generator=gen) * 0.5  # small sinks
    sinks[0], sinks[-1] = 12.0, -30.0  # a sink that dominates the keys, one that vanishes

    def rand(*shape: int, dt: torch.dtype) -> torch.Tensor:
        return torch.randn(shape, generator=gen).to(dt).to(device)

    return Case(pools, torch.tensor(positions, device=device),
                full.to(device=device, dtype=torch.int32), swa.to(device=device, dtype=torch.int32),
                rand(bs, heads, HEAD_DIM, dt=qd), rand(bs, kv_heads, HEAD_DIM, dt=qd),
                rand(bs, kv_heads, HEAD_DIM, dt=qd), sinks.to(device))


def torch_reference(case: Case) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(outputs of layers 0 (full) and 1 (sliding), pools after the writes), pools restored."""
    saved = (case.pools.full.clone(), case.pools.swa.clone())
    attn = DecodeAttention(case.pools, WINDOW, case.positions, case.full, case.swa)
    outs = [attn(layer, case.q, case.k, case.v, case.sinks) for layer in (0, 1)]
    after = [case.pools.full.clone(), case.pools.swa.clone()]
    case.pools.full.copy_(saved[0])
    case.pools.swa.copy_(saved[1])
    return outs, after


def check(case: Case, splits: int) -> None:
    """Kernels with `splits` split-K parts == the torch path: outputs and pool writes."""
    ref, ref_pools = torch_reference(case)
    atol, rtol = TOL[case.pools.dtype]
    bs, heads, _ = case.q.shape
    scratch = partials(bs, heads, HEAD_DIM, splits, case.q.device)
    for layer, table, window in ((0, case.full, NO_WINDOW), (1, case.swa, WINDOW)):
        kv = case.pools.layer_tensor(layer)  # [N + 1, 2, ps, kvh, hd]
        write_kv(kv, case.k, case.v, table, case.positions)
        out = paged_decode(case.q, kv, table, case.positions, case.sinks, window,
                           HEAD_DIM ** -0.5, scratch)  # [bs, heads * hd]
        assert out.dtype == case.q.dtype and out.shape == ref[layer].shape
        torch.testing.assert_close(out.float(), ref[layer].float(), atol=atol, rtol=rtol)
    assert torch.equal(case.pools.full, ref_pools[0])  # the new K/V went to their slots only
    assert torch.equal(case.pools.swa, ref_pools[1])


def edge_positions(page_size: int) -> list[list[int]]:
    """Batches: page edges (pos % ps in {0, 1, ps - 1}); window edges (126-130); windows
    starting mid-page (200: keys [73, 200]); the ring wrapped more than once."""
    ring_tokens = swa_ring_width(WINDOW, page_size) * page_size
    return [[0, 1, page_size - 1, page_size, page_size + 1, 2 * page_size - 1],
            [126, 127, 128, 129, 130],
            [200, 3 * ring_tokens + 5, 2 * ring_tokens + page_size - 1]]


COMBOS = [(ps, dtype, kvh, group) for ps in (16, 64) for dtype in (torch.float32, torch.bfloat16)
          for kvh, group in ((1, 8), (2, 2))]  # GQA 8:1 (gpt-oss) and 2:1


@interpreted
@pytest.mark.parametrize(("page_size", "dtype", "kv_heads", "group"), COMBOS)
def test_edges_of_pages_windows_and_the_ring_match_torch(page_size: int, dtype: torch.dtype,
                                                         kv_heads: int, group: int) -> None:
    for i, positions in enumerate(edge_positions(page_size)):
        check(make_case(positions, page_size, kv_heads, group, dtype, seed=i), splits=1 + i)


# random batches: each page size, dtype and GQA ratio twice, each pair of them once (the
# interpreter is slow; the edge cases above cover the whole product)
PAIRS = [(16, torch.float32, 1, 8), (16, torch.bfloat16, 2, 2), (64, torch.float32, 2, 2),
         (64, torch.bfloat16, 1, 8)]


@interpreted
@pytest.mark.parametrize(("page_size", "dtype", "kv_heads", "group"), PAIRS)
def test_random_batches_of_one_to_nine_requests_match_torch(page_size: int, dtype: torch.dtype,
                                                            kv_heads: int, group: int) -> None:
    rng = random.Random(f"{page_size}{dtype}{kv_heads}")
    for bs in (1, rng.randint(2, 8), 9):
        positions = [rng.randint(0, 500) for _ in range(bs)]
        check(make_case(positions, page_size, kv_heads, group, dtype, seed=bs),
              splits=rng.choice((1, 2, 5)))


@interpreted
def test_a_float32_query_over_a_bfloat16_pool_matches_torch() -> None:
    """kv_dtype below the model dtype: the kernel upcasts K/V and dots in float32."""
    case = make_case([3, 130, 300], 16, 2, 2, torch.bfloat16, q_dtype=torch.float32)
    ref, _ = torch_reference(case)
    out = TritonDecodeAttention(case.pools, WINDOW, case.positions, case.full, case.swa,
                                max_keys=1024)
    for layer in (0, 1):
        got = out(layer, case.q, case.k, case.v, case.sinks)  # [bs, heads * hd] f32
        torch.testing.assert_close(got, ref[layer], atol=1e-5, rtol=1e-5)


@interpreted
def test_the_step_attend_serves_dummy_rows_and_every_layer_of_a_pool() -> None:
    """Graph padding: rows at position 0 with all-zero tables read and write page 0 only;
    layers of one pool share the stage-1 scratch."""
    case = make_case([0, 77, 140, 0], 16, 2, 2, torch.float32)
    case.full[[0, 3]] = 0
    case.swa[[0, 3]] = 0
    for t in (case.q, case.k, case.v):  # padding rows are alike (token 0 at position 0)
        t[3] = t[0]
    ref, ref_pools = torch_reference(case)
    attn = TritonDecodeAttention(case.pools, WINDOW, case.positions, case.full, case.swa,
                                 max_keys=4096)
    for _ in range(2):  # a second pass: the scratch of the first must not leak into it
        outs = [attn(layer, case.q, case.k, case.v, case.sinks) for layer in (0, 1)]
        for got, want in zip(outs, ref, strict=True):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(case.pools.full, ref_pools[0]) and torch.equal(case.pools.swa, ref_pools[1])


def test_split_count_fills_the_device_and_stays_per_batch_bucket(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from decode_worker.device import attention_triton

    assert num_kv_splits(4, 2, 4096, torch.device("cpu")) == 1  # the interpreter: few programs
    monkeypatch.setattr(attention_triton, "_num_sms", lambda device: 132)  # an H200
    cuda = torch.device("cuda")
    splits = [num_kv_splits(bs, 8, 131072, cuda) for bs in (1, 2, 8, 32, 64, 256)]
    assert splits == [MAX_SPLITS, MAX_SPLITS, 9, 3, 2, 1]  # >= 4 programs per SM
    assert num_kv_splits(1, 8, 128, cuda) == 2  # a sliding layer's 128 keys: 2 blocks
    assert num_kv_splits(1, 8, 1, cuda) == 1


def test_the_kernels_compile_for_an_h200(sm90_compiles: Runs) -> None:
    """What the interpreter cannot check (tl.dot shapes, layouts, ptxas): compiled for sm_90
    with the installed triton, no GPU needed (tests/unit/device/sm90_compile.py), with a fresh
    TRITON_CACHE_DIR; run in the background since the first device test (conftest.py)."""
    done = sm90_compiles["attention"].result()
    assert done.returncode == 0, done.stderr[-3000:]
    assert "compiled for sm_90" in done.stdout
