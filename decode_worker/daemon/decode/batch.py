"""The running batch: its requests, and their step state in arrays indexed by `DecodeInputs` row.

A request joins at READY -> RUNNING (`join`: a row of the persistent decode inputs, its whole
page table and input token written once) and leaves by the request table's one exit or by
retraction (`leave`). Between the two, what a step needs of it is kept in numpy arrays over the
rows, so the scheduler's per-step work is a few vector operations over the batch plus Python for
the few rows at an edge:
```
pos       next position to launch at: kv.seq_len + ahead
ahead     launched steps not yet committed (0, or 1 under overlapped scheduling)
edge      first position whose launch needs the host: a full page not held, or an SWA page not
          written to the row (a page edge: one step in page_size)
slide_at  the kv.seq_len at which the SWA window next slides (`DecodeAllocator.slide_due_at`)
left      tokens to go before max_new_tokens (committed)
kind      `SampleKind`
gen       bumped at every join and leave: a launched step's row is still the same request's
          iff its gen is unchanged
```
Pages reach a row only at its edges: the full pages it was given, and SWA pages up to the
position's page (the SWA ring holds the window's pages, not pages held ahead of it):
```
SWA ring of R columns, position p:  page i = p // page_size sits in column i % R;
columns hold pages [i - R + 1, i], a superset of the window's [(p - window) // page_size, i]
```
A request's page lists only grow at the end while it runs (the tree repoints them once, as
it starts running, before it joins), so the written counts say what is new. Rows run in row order.
Stop tokens and EOS of the batch are counted in one table, so a step finds the rows its tokens
may end with one `isin`. Compute thread only.
"""

from __future__ import annotations

import enum
import itertools
from collections import Counter
from collections.abc import Callable

import numpy as np
import torch

from decode_worker.core.decode_alloc import NEVER, DecodeAllocator
from decode_worker.core.request import StepCommit
from decode_worker.daemon.decode.live import LiveRequest
from decode_worker.device.decode_inputs import DecodeInputs
from decode_worker.device.sampler import ParamsBatch, noise_seed, param_columns


class SampleKind(enum.IntEnum):
    """How a request's tokens are chosen; a batch takes its rows' largest kind."""

    GREEDY = 0  # argmax on the device
    DEVICE = 1  # `Sampler.choose_batch` on the device
    HOST = 2  # `Sampler.sample`, waiting for the step (a grammar's mask)


class Order:
    """The batch in row order, as of one membership (cached until a join or leave), with the
    core's `StepCommit` over its requests (the one way a step's tokens are committed)."""

    __slots__ = ("commit", "lives", "rids", "rows")

    def __init__(self, rows: np.ndarray, lives: list[LiveRequest],
                 commit: StepCommit | None = None) -> None:
        self.rows = rows  # [n] i64
        self.lives = lives
        self.rids = [lv.rid for lv in lives]
        self.commit = commit or StepCommit([lv.req for lv in lives])

    def subset(self, mask: np.ndarray) -> Order:
        """The rows where `mask` ([n] bool) is set."""
        keep = mask.tolist()
        return Order(self.rows[mask], list(itertools.compress(self.lives, keep)),
                     self.commit.subset(keep))


class RunningBatch:
    """The RUNNING requests (see the module docstring); `classify` gives a joining request's
    `SampleKind`."""

    def __init__(self, inputs: DecodeInputs, decode_alloc: DecodeAllocator,
                 classify: Callable[[LiveRequest], SampleKind]) -> None:
        self.inputs, self.decode_alloc, self.classify = inputs, decode_alloc, classify
        ctx = decode_alloc.ctx
        self.page_size, self.has_swa = ctx.page_size, ctx.swa is not None
        n = inputs.num_rows + 1  # row 0 is the dummy row, never a request's
        self.lives: list[LiveRequest | None] = [None] * n
        self.pos = np.zeros(n, np.int64)
        self.ahead = np.zeros(n, np.int64)
        self.edge = np.full(n, NEVER, np.int64)
        self.slide_at = np.full(n, NEVER, np.int64)
        self.left = np.zeros(n, np.int64)
        self.kind = np.zeros(n, np.int8)
        self.gen = np.zeros(n, np.int64)
        # sampling parameters (DEVICE rows): temperature (1.0 when greedy), top_k (0: none),
        # top_p, min_p, greedy; seed (-1: none) and max_new_tokens for a seeded row's step
        self.sample_f = np.zeros((n, 5), np.float64)  # `param_columns`
        self.seed = np.full(n, -1, np.int64)
        self.max_new = np.zeros(n, np.int64)
        self.want_lp = np.zeros(n, bool)  # return_logprob
        self.top_n = np.zeros(n, np.int64)  # top_logprobs
        self._num_full = [0] * n  # full pages written to the row
        self._num_swa = [0] * n  # SWA page-list entries written (the ring keeps the window's)
        self._stops: Counter[int] = Counter()  # stop token / EOS -> rows it may end
        self._stop_ids: np.ndarray | None = None  # the keys of `_stops` (None: rebuild)
        self._order: Order | None = None
        self._count = 0
        self._kinds: Counter[SampleKind] = Counter()  # members by kind
        self.version = 0  # bumped at every join and leave
        self.steps_done = 0  # launched steps waited for (the stepper counts them)
        self.logprob_members = 0  # members that want logprobs (none: a step skips them)

    # -- membership ------------------------------------------------------------------------------
    def __len__(self) -> int:
        return self._count

    def __bool__(self) -> bool:
        return self._count > 0

    def __contains__(self, live: object) -> bool:
        return isinstance(live, LiveRequest) and live.row > 0 and self.lives[live.row] is live

    def kind_of_batch(self) -> SampleKind:
        """The largest `SampleKind` of the members (how a step samples; GREEDY when empty)."""
        return max((k for k, n in self._kinds.items() if n > 0), default=SampleKind.GREEDY)

    def order(self) -> Order:
        if self._order is None:
            rows = np.flatnonzero(self.gen & 1)  # a member's gen is odd
            self._order = Order(rows, [self.lives[s] for s in rows.tolist()])  # type: ignore[misc]
        return self._order

    def join(self, live: LiveRequest) -> None:
        """Give RUNNING `live` a row: its page table, input token and step state."""
        req, kv = live.req, live.req.kv
        assert kv is not None and req.output_ids  # RUNNING holds kv and its next input
        row = self.inputs.acquire()
        live.row, self.lives[row] = row, live
        self.pos[row], self.ahead[row] = kv.seq_len, 0
        self.left[row] = req.max_new_tokens - len(req.output_ids)
        self.kind[row] = self.classify(live)
        sp = live.cmd.sampling
        self.sample_f[row] = param_columns(sp)
        self.seed[row] = -1 if sp.seed is None or sp.is_greedy else sp.seed
        self.max_new[row] = req.max_new_tokens
        self.want_lp[row], self.top_n[row] = live.cmd.return_logprob, live.cmd.top_logprobs
        self._num_full[row] = self._num_swa[row] = 0
        self.inputs.write_token(row, req.output_ids[-1])
        self.refresh(live)
        self.slid(live)
        self._count_member(live, row, +1)

    def leave(self, live: LiveRequest) -> int:
        """Take `live` out of the batch (a no-op when it is not in it); its row is free at once
        (writes to a row are ordered after the steps already launched). Returns how many
        launched steps still read its pages (0 when it was not in the batch)."""
        if live not in self:
            return 0
        row = live.row
        in_flight = int(self.ahead[row])
        live.row, self.lives[row] = 0, None
        live.emitted = len(live.req.output_ids)  # every committed token went out
        self.edge[row] = self.slide_at[row] = NEVER
        self.inputs.release(row)
        self._count_member(live, row, -1)
        return in_flight

    def _count_member(self, live: LiveRequest, row: int, sign: int) -> None:
        """The batch-wide counts after `live` joined (+1) or left (-1) row `row`: its gen (odd
        while a member: a launched step's row is the same request iff its gen is unchanged),
        the members by kind and by logprobs, the stop-token table; the cached order goes."""
        self.gen[row] += 1
        self._count += sign
        self.version += 1
        self._kinds[SampleKind(int(self.kind[row]))] += sign
        self.logprob_members += sign * _wants_logprobs(live)
        stops = live.stop_ids
        if sign > 0:
            self._stops.update(stops)
        else:
            self._stops.subtract(stops)
            self._stops = +self._stops  # drop the zero counts
        self._stop_ids, self._order = None, None

    # -- step state ------------------------------------------------------------------------------
    def refresh(self, live: LiveRequest, reach: int | None = None) -> None:
        """After the core gave `live` pages (it grew at its edge): queue the new pages for its
        row and recompute its edge (its slide point moves only when its window slides). SWA
        pages reach the row up to the page of `reach` (default: its next position; a verify
        step writes further, and the ring keeps that much more: `ModelRunner.lookahead`)."""
        row, kv, ps, inputs = live.row, live.req.kv, self.page_size, self.inputs
        assert kv is not None
        full, num_full = kv.full_page_ids, self._num_full[row]
        if len(full) > num_full:
            inputs.write_full(row, num_full, full[num_full:])
            self._num_full[row] = num_full = len(full)
        if self.has_swa:
            swa, written = kv.swa_page_ids, self._num_swa[row]
            num_swa = min(len(swa), (int(self.pos[row]) if reach is None else reach) // ps + 1)
            if num_swa > written:
                inputs.write_swa(row, written, swa[written:num_swa])
                self._num_swa[row] = written = num_swa
            num_full = min(num_full, written)
        self.edge[row] = num_full * ps

    def slid(self, live: LiveRequest) -> None:
        """After the core slid `live`'s window (pages left it; none reach the row), or it
        joined: its next slide point."""
        self.slide_at[live.row] = self.decode_alloc.slide_due_at(live.req.kv)  # type: ignore[arg-type]

    def sample_params(self, rows: np.ndarray, ahead: np.ndarray, vocab: int,
                      dev: torch.device) -> ParamsBatch:
        """The sampling parameters of `rows` ([n]) as tensors on `dev`, a seeded row's
        noise keyed by the index of the token it samples (one further per uncommitted step)."""
        seeds = self.seed[rows]
        seeded = np.flatnonzero(seeds >= 0)
        step = self.max_new[rows[seeded]] - self.left[rows[seeded]] + ahead[seeded]
        return ParamsBatch.of_columns(self.sample_f[rows], vocab, dev, [
            (i, noise_seed(sd, st)) for i, sd, st in zip(
                seeded.tolist(), seeds[seeded].tolist(), step.tolist(), strict=True)])

    def entry_params(self, rows: np.ndarray, counts: np.ndarray, vocab: int,
                     dev: torch.device) -> tuple[ParamsBatch, np.ndarray]:
        """A verify step's sampling parameters per entry (row `rows[i]` in `counts[i]`
        consecutive entries, drawing its next tokens in order), and each entry's noise key
        (`noise_seed` of the token it draws; -1 for an unseeded row)."""
        idx = np.repeat(np.arange(len(rows)), counts)  # [T] the request of each entry
        r = rows[idx]
        within = np.arange(len(idx)) - np.repeat(np.cumsum(counts) - counts, counts)  # [T]
        keys = np.full(len(idx), -1, np.int64)
        seeded = np.flatnonzero(self.seed[r] >= 0)
        if len(seeded):
            step = self.max_new[r[seeded]] - self.left[r[seeded]] + within[seeded]
            keys[seeded] = [noise_seed(sd, st) for sd, st in zip(
                self.seed[r[seeded]].tolist(), step.tolist(), strict=True)]
        return ParamsBatch.of_columns(self.sample_f[r], vocab, dev, []), keys

    def logprobs_wanted(self, rows: np.ndarray) -> tuple[np.ndarray, int]:
        """[n] bool: which of `rows` want logprobs (the token's, or alternatives); and the
        most alternatives any of them wants."""
        top = self.top_n[rows]
        return self.want_lp[rows] | (top > 0), int(top.max()) if len(top) else 0

    def stop_hits(self, tokens: np.ndarray) -> np.ndarray:
        """[n] bool: which of `tokens` ([n] i64) is a stop token or EOS of some row."""
        if not self._stops:
            return np.zeros(len(tokens), bool)
        if self._stop_ids is None:
            self._stop_ids = np.fromiter(self._stops, np.int64, len(self._stops))
        return np.isin(tokens, self._stop_ids)


def _wants_logprobs(live: LiveRequest) -> bool:
    return live.cmd.return_logprob or live.cmd.top_logprobs > 0
