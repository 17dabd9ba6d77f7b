"""Which entries of a decode step are one request's consecutive queries (a verify step).

A verify step holds a request in `1 + k` consecutive entries of `ModelRunner.decode_rows`, same
row, positions `pos .. pos + k`. The Triton attention reads such a group's keys once for all its
queries (device/kernels/verify_attention.py). The description is a device tensor of static shape,
so a CUDA graph captured for a number of entries serves every grouping of them:
```
rows:       [7, 7, 7, 2, 9, 9, 0, 0]      (0, 0: graph padding, each entry its own group)
positions:  [40, 41, 42, 41, 5, 6, 0, 0]
first:      [0, 0, 0, 3, 4, 4, 6, 7]      index of the first entry of each entry's group
max_len:    3                             the longest group (a host int: the kernel's tile)
```
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True, slots=True)
class QueryGroups:
    """first: [bs] i64 on the device (see the module doc); max_len: an upper bound on any
    group's length (a graph uses its bucket's), >= 1."""

    first: torch.Tensor
    max_len: int


def group_starts(rows: Sequence[int] | np.ndarray, positions: Sequence[int] | np.ndarray
                 ) -> np.ndarray:
    """[bs] i64: for each entry, the index of the first entry of its group, a group being a run
    of entries with the same row at consecutive positions."""
    row_a, pos_a = np.asarray(rows, np.int64), np.asarray(positions, np.int64)  # [bs] each
    starts = np.ones(len(row_a), bool)  # [bs]
    starts[1:] = (row_a[1:] != row_a[:-1]) | (pos_a[1:] != pos_a[:-1] + 1)
    return np.maximum.accumulate(np.where(starts, np.arange(len(row_a)), 0))  # [bs]


def longest_group(first: np.ndarray) -> int:
    """The length of the longest run in `first` (group_starts' result); 1 for an empty step."""
    if not len(first):
        return 1
    return int((np.arange(len(first)) - first).max()) + 1
