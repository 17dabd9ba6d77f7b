"""The grouped (verify) decode attention kernel (device/kernels/verify_attention.py) equals the
torch path with one row per entry (device/attention.py, the reference) and the single-query
kernel on the same entries: random groups of 1..9 entries, page and window edges, head_dim 64
and 128, windows up to 4096, groups longer than a program's queries, graph padding.

Interpreted on CPU (tests/conftest.py sets TRITON_INTERPRET=1), so shapes are small; the
tolerances are test_decode_attention_triton.py's (its docstring says why). The grouped and the
single-query kernel split the keys at other block edges, so they differ by summation order only.
Every pool holds random values and each request reads its own random pages, so a wrong page,
slot, window edge or a query that sees another query's keys changes the output.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

from decode_worker.device.attention import DecodeAttention
from decode_worker.device.decode_inputs import swa_ring_width
from decode_worker.device.kernels.decode_attention import (
    NO_WINDOW,
    paged_decode,
    partials,
    write_kv,
)
from decode_worker.device.kernels.verify_attention import paged_verify, queries_per_program
from decode_worker.device.kv_pool import KVPools, KVSpec
from decode_worker.device.query_groups import group_starts
from tests.unit.device.test_decode_attention_triton import TOL, interpreted

K_MAX = 8  # the most drafts per request (the SWA ring keeps window + K_MAX positions)


@dataclass
class Step:
    pools: KVPools
    window: int
    positions: torch.Tensor  # [n] i64, entries of one request consecutive and ascending
    first: torch.Tensor  # [n] i64
    max_len: int
    full: torch.Tensor  # [n, W] i32, a request's row repeated for each of its entries
    swa: torch.Tensor  # [n, ring] i32
    q: torch.Tensor  # [n, heads, hd]
    k: torch.Tensor  # [n, kvh, hd]
    v: torch.Tensor  # [n, kvh, hd]
    sinks: torch.Tensor  # [heads] f32


def make_step(requests: list[tuple[int, int]], page_size: int, kv_heads: int, group: int,
              dtype: torch.dtype, head_dim: int = 64, window: int = 127, seed: int = 0,
              num_pages: int = 96, device: str = "cpu") -> Step:
    """Requests (pos, k): entries at pos .. pos + k over one full and one sliding layer.
    Requests read random (maybe shared) pages; the pages they write are their own."""
    gen, rng = torch.Generator().manual_seed(seed), random.Random(seed)
    pools = KVPools(KVSpec(("full_attention", "sliding_attention"), kv_heads, head_dim),
                    num_pages, num_pages, page_size, device, dtype)
    for t in (pools.full, pools.swa):
        t.copy_(torch.randn(t.shape, generator=gen).to(dtype))  # page 0 too: never read
    ring = swa_ring_width(window + K_MAX, page_size)
    width = max(p + k for p, k in requests) // page_size + 3  # wider than needed
    fresh = iter(rng.sample(range(1, num_pages + 1), 2 * 2 * len(requests)))  # written pages
    full_rows, swa_rows = [], []
    for pos, k in requests:
        full = rng.sample(range(1, num_pages + 1), width)
        swa = rng.sample(range(1, num_pages + 1), ring)
        for col in range(pos // page_size, (pos + k) // page_size + 1):  # <= 2 (k < ps)
            full[col], swa[col % ring] = next(fresh), next(fresh)
        full_rows += [full] * (k + 1)
        swa_rows += [swa] * (k + 1)
    rows = [i for i, (_, k) in enumerate(requests) for _ in range(k + 1)]
    positions = [p + j for p, k in requests for j in range(k + 1)]
    n, heads = len(positions), kv_heads * group
    sinks = torch.randn(heads, generator=gen) * 0.5
    sinks[0], sinks[-1] = 12.0, -30.0  # a sink that dominates the keys, one that vanishes

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen).to(dtype).to(device)

    def dev(values: object, dt: torch.dtype) -> torch.Tensor:
        return torch.as_tensor(values, dtype=dt, device=device)

    return Step(pools, window, dev(positions, torch.long),
                dev(group_starts(rows, positions), torch.long), max(k for _, k in requests) + 1,
                dev(full_rows, torch.int32), dev(swa_rows, torch.int32), rand(n, heads, head_dim),
                rand(n, kv_heads, head_dim), rand(n, kv_heads, head_dim), sinks.to(device))


def run_kernel(step: Step, grouped: bool, splits: int, max_len: int | None = None
               ) -> list[torch.Tensor]:
    """Layer 0 (full) and 1 (sliding) through the grouped or the single-query kernel; the
    pools come back as they were."""
    saved = (step.pools.full.clone(), step.pools.swa.clone())
    n, heads, hd = step.q.shape
    scratch = partials(n, heads, hd, splits, step.q.device)
    outs = []
    for layer, table, window in ((0, step.full, NO_WINDOW), (1, step.swa, step.window)):
        kv = step.pools.layer_tensor(layer)  # [N + 1, 2, ps, kvh, hd]
        write_kv(kv, step.k, step.v, table, step.positions)
        args = (step.sinks, window, hd ** -0.5, scratch)
        outs.append(paged_verify(step.q, kv, table, step.positions, step.first,
                                 max_len or step.max_len, *args) if grouped
                    else paged_decode(step.q, kv, table, step.positions, *args))
    step.pools.full.copy_(saved[0])
    step.pools.swa.copy_(saved[1])
    return outs


def torch_reference(step: Step) -> list[torch.Tensor]:
    saved = (step.pools.full.clone(), step.pools.swa.clone())
    attn = DecodeAttention(step.pools, step.window, step.positions, step.full, step.swa)
    outs = [attn(layer, step.q, step.k, step.v, step.sinks) for layer in (0, 1)]
    step.pools.full.copy_(saved[0])
    step.pools.swa.copy_(saved[1])
    return outs


def check(step: Step, splits: int, max_len: int | None = None, single: bool = True) -> None:
    """grouped == torch reference and (`single`) grouped == single-query kernel, both layers."""
    atol, rtol = TOL[step.pools.dtype]
    got = run_kernel(step, True, splits, max_len)
    wants = [torch_reference(step)] + ([run_kernel(step, False, splits)] if single else [])
    for want in wants:
        for g, w in zip(got, want, strict=True):
            assert g.dtype == step.q.dtype and g.shape == w.shape
            torch.testing.assert_close(g.float(), w.float(), atol=atol, rtol=rtol)


def random_requests(rng: random.Random, page_size: int, top: int, window: int
                    ) -> list[tuple[int, int]]:
    """1..9 entries in all: mixed k, positions at page edges, window edges or anywhere."""
    edges = [0, 1, page_size - 1, page_size, 2 * page_size - 2, window - 1, window, window + 1]
    out, left = [], rng.randint(1, 9)
    while left:
        k = rng.randint(0, min(K_MAX, left - 1))
        pos = rng.choice(edges) if rng.random() < 0.5 else rng.randint(0, top)
        out.append((max(0, pos - rng.randint(0, k)), k))  # a group that crosses the edge
        left -= k + 1
    return out


# (page, dtype, kv heads, GQA group, head_dim): each value twice, each pair of them about once
COMBOS = [(16, torch.float32, 1, 8, 64), (16, torch.bfloat16, 2, 2, 128),
          (64, torch.float32, 2, 2, 128), (64, torch.bfloat16, 1, 8, 64)]


@interpreted
@pytest.mark.parametrize(("page_size", "dtype", "kv_heads", "group", "head_dim"), COMBOS)
def test_random_groups_match_torch_and_the_single_query_kernel(
        page_size: int, dtype: torch.dtype, kv_heads: int, group: int, head_dim: int) -> None:
    rng = random.Random(f"{page_size}{dtype}{head_dim}")
    for i in range(3):
        window = rng.choice((127, 200))
        step = make_step(random_requests(rng, page_size, 400, window), page_size, kv_heads,
                         group, dtype, head_dim, window, seed=i)
        check(step, splits=rng.choice((1, 2, 5)))


@interpreted
def test_a_4096_window_read_once_per_request() -> None:
    """Windows up to 4096 (head_dim 128, page 64): the first query's window starts a page
    earlier than the last one's, so keys the first sees are masked for the last."""
    step = make_step([(4096 + 60, 8), (4200, 0)], 64, 1, 2, torch.float32, head_dim=128,
                     window=4096, num_pages=240)
    check(step, splits=3, single=False)  # the interpreter reads 4k keys per entry slowly


@interpreted
def test_groups_longer_than_a_program_and_a_graph_bucket_wider_than_the_groups() -> None:
    """16 heads per KV head: 8 queries per program (4 over float32 pools), so a group of 9
    has two (three) leaders; and the kernel launched for groups of up to 16 (a graph's group
    bucket) when the longest is 9."""
    assert queries_per_program(9, 16, False) == 8 and queries_per_program(9, 8, False) == 16
    assert queries_per_program(9, 16, True) == 4 and queries_per_program(9, 8, True) == 8
    assert queries_per_program(1, 8, False) == 1 and queries_per_program(3, 3, False) == 4
    for dtype in (torch.float32, torch.bfloat16):
        step = make_step([(70, 8), (71, 1), (300, 8)], 16, 1, 16, dtype)
        check(step, splits=2)
    check(step, splits=1, max_len=16)


@interpreted
def test_neighbours_at_consecutive_positions_and_graph_padding_stay_apart() -> None:
    """Two requests in adjacent entries at consecutive positions are two groups (group_starts
    looks at rows too); padding rows (position 0, page 0, their own group) read page 0 only."""
    assert group_starts([3, 3, 5, 5, 5, 0, 0], [9, 10, 11, 12, 13, 0, 0]).tolist() == [
        0, 0, 2, 2, 2, 5, 6]
    step = make_step([(40, 1), (42, 2), (0, 0), (0, 0)], 16, 2, 2, torch.float32)
    step.first = torch.from_numpy(group_starts([1, 1, 2, 2, 2, 0, 0], [40, 41, 42, 43, 44, 0, 0]))
    step.full[-2:] = 0
    step.swa[-2:] = 0
    for t in (step.k, step.v):  # both write page 0's slot 0: padding rows are alike
        t[-1] = t[-2]
    check(step, splits=2)
