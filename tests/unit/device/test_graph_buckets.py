"""CUDA-graph bucket choice (pure; the capture itself is tested in tests/gpu)."""

from __future__ import annotations

from pathlib import Path

import torch

from decode_worker.device.cuda_graph import (
    CudaGraphDecoder,
    FakeGraphBackend,
    capture_widths,
    graph_bucket,
    group_bucket,
)
from decode_worker.device.query_groups import QueryGroups
from decode_worker.settings import load_settings
from decode_worker.utils.mathx import cdiv

H200_CONFIG = Path(__file__).parents[3] / "configs" / "gpt-oss-20b-h200.toml"


def test_bucket_is_the_smallest_size_and_power_of_two_width() -> None:
    sizes = [1, 2, 4, 8, 16, 24, 32, 48, 64]
    assert graph_bucket(sizes, 256, 1, 1) == (1, 1)
    assert graph_bucket(sizes, 256, 3, 5) == (4, 8)
    assert graph_bucket(sizes, 256, 17, 64) == (24, 64)
    assert graph_bucket(sizes, 256, 64, 65) == (64, 128)
    assert graph_bucket(sizes, 200, 9, 150) == (16, 200)  # capped at max_pages
    assert capture_widths(13, 32) == [1, 2, 4, 8, 13]
    assert capture_widths(100, 32) == [1, 2, 4, 8, 16, 32]


def _step(tokens: torch.Tensor, positions: torch.Tensor, full_t: torch.Tensor,
          swa_t: torch.Tensor, groups: QueryGroups | None) -> torch.Tensor:
    return torch.zeros(tokens.shape[0], 1)  # [B, 1]


def test_the_h200_config_captures_one_graph_per_batch_bucket_with_the_triton_kernel() -> None:
    """gpt-oss-20b's 131072-token context in pages of 64 is a 2048-page table; the config's
    start-up capture covers 8192 tokens: 14 x 8 graphs per (batch, width) bucket (torch
    attention), 14 at the full width with the Triton kernel."""
    s = load_settings(H200_CONFIG).settings
    max_pages = cdiv(131072, s.cache.page_size)
    widths = capture_widths(cdiv(s.scheduler.cuda_graph_capture_tokens, s.cache.page_size),
                            max_pages)
    counts = {}
    for width_buckets in (True, False):
        decoder = CudaGraphDecoder(_step, torch.device("cpu"), s.scheduler.cuda_graph_batch_sizes,
                                   max_pages, FakeGraphBackend(), swa_ring=3,
                                   width_buckets=width_buckets)
        decoder.capture_all(widths)
        counts[width_buckets] = len(decoder.graphs)
        if not width_buckets:
            assert {pages for _, pages in decoder.graphs} == {max_pages}
            assert decoder.bucket(3, 5) == (4, max_pages)
    assert counts == {True: 112, False: 14}


def test_a_verify_step_runs_in_its_group_buckets_graph_with_padding_rows_alone() -> None:
    """Grouped steps get graphs of their own per (size, width, group bucket); each replay sees
    this step's `first` and padding rows as groups of one, whatever an earlier step left."""
    seen: list[tuple[list[int], int] | None] = []

    def step(tokens: torch.Tensor, positions: torch.Tensor, full_t: torch.Tensor,
             swa_t: torch.Tensor, groups: QueryGroups | None) -> torch.Tensor:
        seen.append(None if groups is None else (groups.first.tolist(), groups.max_len))
        return torch.zeros(tokens.shape[0], 1)  # [B, 1]

    assert [group_bucket(n) for n in (1, 2, 3, 5, 9)] == [1, 2, 4, 8, 16]
    decoder = CudaGraphDecoder(step, torch.device("cpu"), [8], 16, FakeGraphBackend(),
                               swa_ring=3, width_buckets=False)

    def run(first: list[int] | None, max_len: int = 0) -> tuple[list[int], int] | None:
        n = len(first) if first else 2
        groups = QueryGroups(torch.tensor(first), max_len) if first else None
        decoder.run(torch.zeros(n, dtype=torch.long), torch.zeros(n, dtype=torch.long),
                    torch.zeros(n, 2, dtype=torch.int32), torch.zeros(n, 3, dtype=torch.int32),
                    groups)
        return seen[-1]  # what the replay saw

    assert run([0, 0, 0, 3, 3], 3) == ([0, 0, 0, 3, 3, 5, 6, 7], 4)
    assert run([0, 0, 2], 2) == ([0, 0, 2, 3, 4, 5, 6, 7], 2)
    assert run([0, 1, 1, 1], 3) == ([0, 1, 1, 1, 4, 5, 6, 7], 4)  # the first graph, reused
    assert run(None) is None
    assert set(decoder.grouped) == {(8, 16, 4), (8, 16, 2)} and set(decoder.graphs) == {(8, 16)}
    decoder.capture_all([16], group_lens=(9,))
    assert set(decoder.grouped) == {(8, 16, 4), (8, 16, 2), (8, 16, 16)}
