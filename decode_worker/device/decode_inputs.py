"""Decode inputs kept per request between steps, not rebuilt per token.

Each running request owns a row of three persistent device tensors (the two page
tables are views of one tensor, so a step's page writes are one scatter):
```
full:   [rows + 1, max_pages]  i32  full page of position p at column p // page_size
swa:    [rows + 1, ring]       i32  SWA page of position p at column (p // page_size) % ring
tokens: [rows + 1]             i64  the next input token (the sampler writes it on the device)
```
Row 0 is the dummy row (all zeros: page 0 is the dummy page), the row of graph padding and of
freed rows. `ring = cdiv(window, page_size) + 1` columns hold the pages of the `window + 1`
positions a sliding query sees (`window` = earlier tokens seen, HF `sliding_window - 1`), so the
SWA table is sized to the window, not to the context.

Writes are queued as (row, column, value) triples and applied by `flush()` in one scatter per
table, staged through pinned host memory with non-blocking copies on CUDA. A step reads
`gather(rows, width)`: device-side row selects, so a step costs O(batch) host work however long
the contexts are. Freed rows may be reused at once: on CUDA every write is stream-ordered after
the steps already launched, so an in-flight step still reads the old row.

Not thread-safe: the compute thread only.
"""

from __future__ import annotations

import numpy as np
import torch

from decode_worker.errors import PageError
from decode_worker.utils.mathx import cdiv

_BLOCK = 16  # page writes longer than this are queued as one numpy block


class DecodeInputs:
    """Persistent page tables and next-token buffer of up to `num_rows` running requests."""

    def __init__(self, num_rows: int, max_pages: int, window: int, page_size: int,
                 pool_pages: tuple[int, int], device: torch.device) -> None:
        """`pool_pages`: (full, swa) pool sizes; page ids above them are refused (PageError)."""
        self.device, self.page_size, self.max_pages = device, page_size, max_pages
        self.num_rows = num_rows
        self.ring = swa_ring_width(window, page_size)
        self.pool_pages = pool_pages
        rows = num_rows + 1
        # both page tables in one tensor, so a step's page writes are one scatter
        self._tables = torch.zeros(rows, max_pages + self.ring, dtype=torch.int32,
                                   device=device)  # [R, P + ring]
        self.full = self._tables[:, :max_pages]  # [R, P] (a view)
        self.swa = self._tables[:, max_pages:]  # [R, ring] (a view)
        self.tokens = torch.zeros(rows, dtype=torch.long, device=device)  # [R]
        self._free = list(range(num_rows, 0, -1))  # pop() hands out 1, 2, ...
        self._pin = device.type == "cuda"
        # queued writes: flat (row, col, value) triples per table
        self._full_w: list[int] = []
        self._full_blocks: list[np.ndarray] = []  # long writes, [3 n] i64 each
        self._swa_w: list[int] = []
        self._tok_w: list[int] = []

    @property
    def num_free(self) -> int:
        return len(self._free)

    def acquire(self) -> int:
        """A free row (its tables are written by the caller before its first step)."""
        if not self._free:
            raise PageError("decode inputs: every row is in use (more running requests than "
                            "scheduler.max_running_requests)")
        return self._free.pop()

    def release(self, row: int) -> None:
        """Give `row` back; its stale entries are overwritten before anyone reads them."""
        self._free.append(row)

    def write_full(self, row: int, first_idx: int, page_ids: list[int]) -> None:
        """Full pages of logical pages [first_idx, first_idx + len(page_ids)) (checked at
        `flush`)."""
        n = len(page_ids)
        if n > _BLOCK:  # a whole table at a request's first step: one array, not n triples
            block = np.empty((n, 3), np.int64)  # [n, 3] (row, col, value)
            block[:, 0] = row
            block[:, 1] = np.arange(first_idx, first_idx + n)
            block[:, 2] = page_ids
            self._full_blocks.append(block.ravel())
            return
        w = self._full_w
        for i, page in enumerate(page_ids, first_idx):
            w += (row, i, page)

    def write_swa(self, row: int, first_idx: int, page_ids: list[int]) -> None:
        """SWA pages of logical pages [first_idx, ...); only the last `ring` can matter
        (checked at `flush`)."""
        start = max(first_idx, first_idx + len(page_ids) - self.ring)
        w, ring = self._swa_w, self.ring
        for i in range(start, first_idx + len(page_ids)):
            w += (row, i % ring, page_ids[i - first_idx])

    def write_token(self, row: int, token_id: int) -> None:
        """The next input token of `row`, from the host (a request's first step)."""
        self._tok_w += (row, token_id)

    def flush(self) -> None:
        """Apply every queued write: one scatter per table, of the last value queued for each
        entry (a freed row reused in the same step, an SWA ring column written twice: a
        scatter with repeated indices is unordered on CUDA). Raises PageError, writing nothing,
        when a page id is outside its pool or a full page lies past the table width (checked
        here over the whole batch of writes, not per write)."""
        full = swa = None
        if self._full_blocks or self._full_w:
            full = np.concatenate([*self._full_blocks, np.asarray(self._full_w, np.int64)])
        if self._swa_w:
            swa = np.asarray(self._swa_w, np.int64)
        tok, self._tok_w = self._tok_w, []
        self._full_w, self._swa_w, self._full_blocks = [], [], []
        if full is not None:
            full = full.reshape(-1, 3)  # [n, 3] (row, col, value)
            if int(full[:, 1].max()) >= self.max_pages:
                raise PageError(f"decode inputs: page {int(full[:, 1].max())} past the "
                                f"table width {self.max_pages}")
            check_page_ids(full[:, 2], self.pool_pages[0], "full")
        if swa is not None:
            swa = swa.reshape(-1, 3)  # [n, 3]
            check_page_ids(swa[:, 2], self.pool_pages[1], "swa")
        width = self.max_pages + self.ring  # flat index into both tables
        parts = [] if full is None else [(full[:, 0] * width + full[:, 1], full[:, 2])]
        if swa is not None:
            parts.append((swa[:, 0] * width + self.max_pages + swa[:, 1], swa[:, 2]))
        if len(parts) == 1:
            self._scatter(self._tables, *parts[0])
        elif parts:
            self._scatter(self._tables, np.concatenate([p[0] for p in parts]),
                          np.concatenate([p[1] for p in parts]))
        if tok:
            pairs = np.asarray(tok, np.int64).reshape(-1, 2)  # [n, 2] (row, token)
            self._scatter(self.tokens, pairs[:, 0], pairs[:, 1])

    def gather(self, rows: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor,
                                                                torch.Tensor]:
        """Inputs of a step over `rows` ([bs] i64 on the device): (tokens [bs] i64,
        full [bs, width] i32, swa [bs, ring] i32). Call `flush()` first."""
        tokens = self.tokens[rows]  # [bs]
        full = self.full[rows, :width]  # [bs, width]
        swa = self.swa[rows]  # [bs, ring]
        return tokens, full, swa

    def to_device(self, values: list[int] | np.ndarray) -> torch.Tensor:
        """A [n] i64 device tensor of `values` (pinned staging, non-blocking on CUDA)."""
        return self._stage(values)

    def _scatter(self, table: torch.Tensor, flat: np.ndarray, values: np.ndarray) -> None:
        """table.view(-1)[flat] = values, the last value winning where `flat` repeats."""
        n = len(flat)
        if 1 < n <= _BLOCK * 16:  # a step's writes: dedupe in a dict (later keys overwrite)
            last = dict(zip(flat.tolist(), values.tolist(), strict=True))
            if len(last) != n:
                flat = np.fromiter(last.keys(), np.int64, len(last))
                values = np.fromiter(last.values(), np.int64, len(last))
        elif n > 1:  # whole tables of joining requests
            _, first = np.unique(flat[::-1], return_index=True)  # last occurrences, reversed
            if len(first) != n:
                keep = n - 1 - first
                flat, values = flat[keep], values[keep]
        dtype = np.int32 if table.dtype == torch.int32 else np.int64
        table.view(-1).put_(self._stage(flat), self._stage(values.astype(dtype, copy=False)))

    def _stage(self, values: list[int] | np.ndarray) -> torch.Tensor:
        """A device tensor of `values` (a list: i64), through pinned memory on CUDA."""
        host = (torch.from_numpy(np.ascontiguousarray(values))
                if isinstance(values, np.ndarray) else torch.tensor(values, dtype=torch.long))
        if not self._pin:
            return host
        return host.pin_memory().to(self.device, non_blocking=True)  # [n]


def swa_ring_width(window: int, page_size: int) -> int:
    """Columns of an SWA page table kept as a ring: the pages of the `window + 1` positions a
    sliding query sees (see the module doc)."""
    return cdiv(window, page_size) + 1


def check_page_ids(ids: list[int] | np.ndarray, num_pages: int, pool: str) -> None:
    """Raises PageError unless every id is a page of the pool (0 = the dummy page)."""
    if not len(ids):
        return
    lo, hi = ((int(ids.min()), int(ids.max())) if isinstance(ids, np.ndarray)
              else (min(ids), max(ids)))
    if lo < 0 or hi > num_pages:
        raise PageError(f"{pool} page ids must be in [0, {num_pages}], got {lo}..{hi}")


class HostTokens:
    """Sampled token ids (and any `extras`: the step's logprobs) on their way to the host: on
    CUDA non-blocking copies into pinned memory and an event; `wait()` blocks on that event
    only (later launches keep running)."""

    def __init__(self, chosen: torch.Tensor, extras: tuple[torch.Tensor, ...] = ()) -> None:
        """chosen: [bs] i64 on the device; extras: tensors of the same step, on the device."""
        self._event: torch.cuda.Event | None = None
        if chosen.device.type == "cuda":
            self._host, *more = [_to_pinned(t) for t in (chosen, *extras)]  # [bs], ...
            self._extras = tuple(more)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host, self._extras = chosen, extras  # [bs]

    def wait(self) -> list[int]:
        return self.wait_array().tolist()  # type: ignore[no-any-return]

    def wait_array(self) -> np.ndarray:
        """[bs] i64 token ids, once the step that chose them is done."""
        if self._event is not None:
            self._event.synchronize()
        return self._host.numpy()

    def extras(self) -> tuple[torch.Tensor, ...]:
        """The `extras`, on the host (call after `wait_array`)."""
        return self._extras


def _to_pinned(t: torch.Tensor) -> torch.Tensor:
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host
