"""Hypothesis example budgets for the property and stateful tests.

Each test names its full count; the suite runs `examples(full)`: two fifths of it (at least 30),
which keeps `pytest` on a 2-core CI runner within its time while every property still runs on
many fresh examples per run (the examples differ from run to run, so coverage accumulates). A
failing example is saved in `.hypothesis/` and replayed first on the next run whatever the
budget. `HYPOTHESIS_THOROUGH=1` runs the full counts (nightly, or when chasing a bug)."""

from __future__ import annotations

import os

THOROUGH = os.environ.get("HYPOTHESIS_THOROUGH", "") not in ("", "0")


def examples(full: int) -> int:
    """The number of examples to run for a test whose full count is `full`."""
    return full if THOROUGH else max(30, full * 2 // 5)
