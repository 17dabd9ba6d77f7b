"""CUDA-graph bucket choice (pure; the capture itself is tested in tests/gpu)."""

from __future__ import annotations

from decode_worker.device.cuda_graph import graph_bucket


def test_bucket_is_the_smallest_size_and_power_of_two_width() -> None:
    sizes = [1, 2, 4, 8, 16, 24, 32, 48, 64]
    assert graph_bucket(sizes, 256, 1, 1) == (1, 1)
    assert graph_bucket(sizes, 256, 3, 5) == (4, 8)
    assert graph_bucket(sizes, 256, 17, 64) == (24, 64)
    assert graph_bucket(sizes, 256, 64, 65) == (64, 128)
    assert graph_bucket(sizes, 200, 9, 150) == (16, 200)  # capped at max_pages
