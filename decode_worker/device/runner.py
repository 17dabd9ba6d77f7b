"""ModelRunner: the only forward entry points: prefill one request, decode the rows of a batch.

Page tables are the per-request lists of docs/CONTRACTS.md: `full_page_ids[i]` / `swa_page_ids[i]`
hold the pages of token positions [i * page_size, (i + 1) * page_size); an SWA id 0 is a page that
is not held (before the window start). `window` below is HF `sliding_window - 1`.

Not thread-safe: call from the compute thread only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch

from decode_worker.device.attention import PrefillAttention
from decode_worker.device.attention_backend import (
    AttentionBackend,
    decode_attention,
    resolve_attention_backend,
)
from decode_worker.device.cuda_graph import CudaGraphDecoder, GraphBackend, capture_widths
from decode_worker.device.decode_inputs import (
    DecodeInputs,
    HostTokens,
    check_page_ids,
    swa_ring_width,
)
from decode_worker.device.kv_pool import KVPools
from decode_worker.device.model.base import CausalLM
from decode_worker.device.query_groups import QueryGroups, group_starts, longest_group
from decode_worker.errors import ClientError, PageError
from decode_worker.utils.mathx import cdiv

log = logging.getLogger(__name__)


class DecodeRunner(Protocol):
    """What the decode stepper needs of a runner: `ModelRunner`, or a test/benchmark stand-in
    (`tests/fakes/fake_device.py`)."""

    def new_inputs(self, num_rows: int) -> DecodeInputs: ...

    def decode_rows(self, inputs: DecodeInputs, rows: Sequence[int] | np.ndarray,
                    positions: Sequence[int] | np.ndarray,
                    drafts: tuple[np.ndarray, np.ndarray] | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        ...

    def fetch_tokens(self, chosen: torch.Tensor, extras: tuple[torch.Tensor, ...] = ()
                     ) -> HostTokens: ...


class ModelRunner:
    """Runs `model` over `pools`; owns the CUDA graphs (if any)."""

    def __init__(self, model: CausalLM, pools: KVPools, *, use_cuda_graph: bool,
                 graph_batch_sizes: list[int], max_graph_pages: int | None = None,
                 graph_backend: GraphBackend | None = None,
                 attention_backend: AttentionBackend | str = "auto", lookahead: int = 0) -> None:
        """`max_graph_pages`: widest page table a graph is captured for (default: the
        model's max_position_embeddings, capped at the full pool); wider batches run eager.
        Graphs are CUDA graphs on a CUDA device; `graph_backend` replaces them (tests run the
        graph path on CPU with `FakeGraphBackend`). `attention_backend`: `auto` resolves here,
        `triton` is taken as is (CPU: tests under TRITON_INTERPRET=1), one graph per bucket.
        `lookahead`: the most positions past its next one a request's step may write (verified
        draft tokens): the SWA ring keeps that many more positions, so a written draft never
        lands on a page some query of the step still reads."""
        self.model = model
        self.pools = pools
        self.window = model.cfg.window
        self.scale = model.cfg.attn_scale
        self.has_swa = pools.spec.num_swa_layers > 0  # else SWA tables are never read
        self.device = model.device
        self.lookahead = lookahead
        self.swa_ring = swa_ring_width(self.window + lookahead, pools.page_size)  # columns
        self.max_pages = min(cdiv(model.cfg.max_position_embeddings, pools.page_size),
                             pools.num_pages["full"])  # widest page table
        self.attention_backend: AttentionBackend = (
            "triton" if attention_backend == "triton"
            else resolve_attention_backend(attention_backend, self.device))
        self.graphs: CudaGraphDecoder | None = None
        if use_cuda_graph and (self.device.type == "cuda" or graph_backend is not None):
            self.graphs = CudaGraphDecoder(
                self.eager_step, self.device, graph_batch_sizes,
                max_graph_pages or self.max_pages, graph_backend, swa_ring=self.swa_ring,
                width_buckets=self.attention_backend == "torch")

    @torch.inference_mode()
    def prefill(self, token_ids: list[int], full_page_ids: list[int], swa_page_ids: list[int],
                *, start_pos: int = 0) -> torch.Tensor:
        """Compute positions [start_pos, len(token_ids)); return the last one's logits [V] f32.

        Reads the KV of [0, start_pos) through the page tables (SWA: only the last `window`
        positions before start_pos, which must be held), writes the KV of the new positions.
        Raises PageError when the tables do not cover the positions, ClientError for a token
        id outside the vocabulary.
        """
        seq_len = len(token_ids)
        need = self._check_prefill(seq_len, full_page_ids, swa_page_ids, start_pos)
        vocab = self.model.cfg.vocab_size
        if min(token_ids) < 0 or max(token_ids) >= vocab:
            raise ClientError(f"prefill: token ids must be in [0, {vocab})")
        dev = self.device
        tokens = torch.tensor(token_ids[start_pos:], dtype=torch.long, device=dev)  # [T]
        positions = torch.arange(start_pos, seq_len, device=dev)  # [T]
        full_t = torch.tensor(full_page_ids[:need], dtype=torch.long, device=dev)  # [pages]
        swa_t = torch.tensor(swa_page_ids[:need], dtype=torch.long, device=dev)  # [pages]
        attn = PrefillAttention(self.pools, self.window, start_pos, seq_len - start_pos,
                                full_t, swa_t, self.scale)
        hidden = self.model.forward(tokens, positions, attn)  # [T, H]
        return self.model.logits(hidden[-1:])[0]  # [V] f32

    def _check_prefill(self, seq_len: int, full_page_ids: list[int], swa_page_ids: list[int],
                       start_pos: int) -> int:
        """Raise PageError unless the tables cover [0, seq_len) and the SWA window before
        start_pos is held; return the number of pages used."""
        ps = self.pools.page_size
        if not 0 <= start_pos < seq_len:
            raise PageError(f"prefill: start_pos {start_pos} outside [0, {seq_len})")
        need = cdiv(seq_len, ps)
        if len(full_page_ids) < need or len(swa_page_ids) < need:
            raise PageError(f"prefill: {seq_len} tokens need {need} pages, got "
                            f"{len(full_page_ids)} full / {len(swa_page_ids)} swa")
        first_swa_read = max(0, start_pos - self.window) // ps
        if self.has_swa and start_pos and 0 in swa_page_ids[first_swa_read:cdiv(start_pos, ps)]:
            raise PageError(f"prefill: SWA pages of [{start_pos - self.window}, {start_pos}) "
                            "must be held to extend from start_pos")
        check_page_ids(full_page_ids[:need], self.pools.num_pages["full"], "full")
        check_page_ids(swa_page_ids[:need], self.pools.num_pages["swa"], "swa")
        return need

    def new_inputs(self, num_rows: int) -> DecodeInputs:
        """Persistent decode inputs for up to `num_rows` running requests (`decode_rows`)."""
        pools = self.pools
        return DecodeInputs(num_rows, self.max_pages, self.window + self.lookahead,
                            pools.page_size, (pools.num_pages["full"], pools.num_pages["swa"]),
                            self.device)

    @torch.inference_mode()
    def decode_rows(self, inputs: DecodeInputs, rows: Sequence[int] | np.ndarray,
                    positions: Sequence[int] | np.ndarray,
                    drafts: tuple[np.ndarray, np.ndarray] | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One step for the requests in `rows` of `inputs`, each at `positions[i]`, its input
        token `inputs.tokens[row]`. The caller keeps the rows' tables covering the
        positions (SWA: the window) and page ids are checked when written, not here.

        A request may appear in several consecutive entries of `rows` at consecutive positions
        (a verify step: its input token, then its draft tokens): each entry is one query, every
        entry's K/V is written before any is read, so a draft sees those before it. `drafts`
        = (entry indices, their input tokens) replaces those entries' tokens; with it the
        Triton attention reads each such request's keys once (`QueryGroups`).

        Returns (logits [bs, V] f32, row ids [bs] i64 on the device). The logits may be the
        graph's static output: valid until the next decode call (sample before it).
        """
        inputs.flush()
        row_a, pos_a = np.asarray(rows, np.int64), np.asarray(positions, np.int64)
        bs, width = len(row_a), int(pos_a.max()) // self.pools.page_size + 1
        first = self._group_starts(row_a, pos_a, drafts)  # [bs] or [0]
        parts = (row_a, pos_a, first) if drafts is None else (row_a, pos_a, first, *drafts)
        both = inputs.to_device(np.concatenate(parts))  # [2 bs + g (+ 2 d)] i64, one copy
        rows_t, positions_t = both[:bs], both[bs:2 * bs]  # [bs] each
        groups = QueryGroups(both[2 * bs:3 * bs], longest_group(first)) if len(first) else None
        tokens, full_t, swa_t = inputs.gather(rows_t, width)  # [bs], [bs, width], [bs, ring]
        if drafts is not None:  # verified drafts: their rows' input tokens come from the host
            d, at = len(drafts[0]), 2 * bs + len(first)
            tokens[both[at:at + d]] = both[at + d:]  # tokens: [bs]
        return self._run(tokens, positions_t, full_t, swa_t, groups), rows_t

    def _group_starts(self, rows: np.ndarray, positions: np.ndarray,
                      drafts: tuple[np.ndarray, np.ndarray] | None) -> np.ndarray:
        """`group_starts` of a verify step that groups entries: on the Triton backend, and on
        the torch path when it runs eagerly (its graphs have no grouped shapes); else empty
        (keys read per entry; groups of one are a plain step)."""
        if drafts is None or not len(drafts[0]) or (self.attention_backend != "triton"
                                                    and self.graphs is not None):
            return np.empty(0, np.int64)
        return group_starts(rows, positions)  # [bs]

    @torch.inference_mode()
    def step_seconds(self, entries: Sequence[int], context: int, group: int = 1,
                     repeats: int = 3) -> list[tuple[int, float]]:
        """How long a decode step of each of `entries` entries takes (the fastest of `repeats`,
        after a warm-up: other load only ever adds time): requests of `group` consecutive
        entries each (1: plain steps; 1 + K: verify steps, drafts and all, so a kernel that
        reads a request's KV once is timed as it runs), at positions from `context` on the
        dummy page. Speculation's cost model. Writes only the dummy page."""
        ps = self.pools.page_size
        context = min(context, self.max_pages * ps - 1 - group)
        inputs = self.new_inputs(cdiv(max(entries), group))
        rows = [inputs.acquire() for _ in range(cdiv(max(entries), group))]
        out = []
        for n in entries:
            within = np.arange(n) % group  # [n] 0 .. group - 1 per request
            drafts = (np.flatnonzero(within), np.zeros(int((within > 0).sum()), np.int64))
            times = []
            for _ in range(repeats + 1):
                t0 = time.perf_counter()
                logits, _ = self.decode_rows(inputs, [rows[i // group] for i in range(n)],
                                             (context + within).tolist(),
                                             drafts if group > 1 else None)
                logits.sum().item()  # waits for the step
                times.append(time.perf_counter() - t0)
            out.append((n, min(times[1:])))
        return out

    def fetch_tokens(self, chosen: torch.Tensor, extras: tuple[torch.Tensor, ...] = ()
                     ) -> HostTokens:
        """Start copying sampled token ids [bs] to the host; `wait()` on the result blocks
        until this step (and only the work launched before it) is done."""
        return HostTokens(chosen, extras)

    def _run(self, tokens: torch.Tensor, positions: torch.Tensor, full_t: torch.Tensor,
             swa_t: torch.Tensor, groups: QueryGroups | None) -> torch.Tensor:
        """Graph (when one fits) or eager: [bs, V] f32 logits, maybe a static buffer's view."""
        if self.graphs is not None and self.graphs.can_run(*full_t.shape):
            return self.graphs.run(tokens, positions, full_t, swa_t, groups)
        return self.eager_step(tokens, positions, full_t, swa_t, groups)

    def eager_step(self, tokens: torch.Tensor, positions: torch.Tensor,
                   full_t: torch.Tensor, swa_t: torch.Tensor,
                   groups: QueryGroups | None = None) -> torch.Tensor:
        """Pure tensor step (graph-capturable; a memory probe's step): [bs] tokens -> [bs, V]
        f32 logits. The tables are not checked: page 0 is the dummy page. `groups`: a verify
        step's groups of entries (device/query_groups.py)."""
        attn = decode_attention(self.attention_backend, self.pools, self.window, positions,
                                full_t, swa_t, max_keys=self.max_pages * self.pools.page_size,
                                scale=self.scale, groups=groups)
        hidden = self.model.forward(tokens, positions, attn, static=self.graphs is not None)
        return self.model.logits(hidden)  # [bs, V]

    def capture_graphs(self, max_context_len: int, group_lens: tuple[int, ...] = ()) -> int:
        """Capture every (size bucket, width bucket) up to `max_context_len` tokens now, so that
        no step pays a capture later; no-op without graphs. Returns the number of graphs. With
        the Triton backend the width does not matter: one graph per size bucket, and one more
        per size bucket and verify group bucket of `group_lens` (1 + k for the k a verify step
        may have; the torch path has no grouped graphs)."""
        if self.graphs is None:
            return 0
        pages = cdiv(max_context_len, self.pools.page_size)
        lens = group_lens if self.attention_backend == "triton" else ()
        with torch.inference_mode():
            self.graphs.capture_all(capture_widths(pages, self.graphs.max_pages), lens)
        return len(self.graphs.graphs) + len(self.graphs.grouped)

    def destroy(self) -> None:
        """Release graph memory (call before the pools are deregistered)."""
        if self.graphs is not None:
            self.graphs.destroy()
            self.graphs = None

