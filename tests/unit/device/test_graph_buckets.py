"""CUDA-graph bucket choice (pure; the capture itself is tested in tests/gpu)."""

from __future__ import annotations

from pathlib import Path

import torch

from decode_worker.device.cuda_graph import (
    CudaGraphDecoder,
    FakeGraphBackend,
    capture_widths,
    graph_bucket,
)
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
          swa_t: torch.Tensor) -> torch.Tensor:
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
