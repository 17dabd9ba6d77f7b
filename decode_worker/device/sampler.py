"""Token sampling for a decode batch: greedy, temperature, top-k, top-p, min-p, per-request seed.

One call samples every row of a [bs, V] logits tensor. An all-greedy batch takes the argmax path
only. Otherwise the filters run vectorized on probabilities sorted once per step, and the token is
drawn with the exponential race (argmax of p / E, E ~ Exp(1)), which samples exactly from p.
A row with `seed` draws its noise from its own generator seeded by (seed, step), so the same seed
gives the same tokens whatever the batch around it; other rows share the sampler's generator.

Logprobs (on request) are those of the chosen token under the model's raw distribution
(log_softmax of the unscaled logits, before temperature and filters); `top_logprobs` > 0 asks for
that many most likely tokens of the same distribution too, most likely first.

A row with a grammar (structured output, device/grammar.py) samples from its logits with every
token the grammar forbids at -inf, before temperature and the filters (greedy rows too); its
logprobs stay those of the raw distribution. A batch without a grammar does no mask work.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from decode_worker.core.sampling import SamplingParams, TopLogprobs
from decode_worker.device.grammar import GrammarState, mask_logits

_SEED_MIX = 1_000_003


@dataclass(frozen=True, slots=True)
class SampleRow:
    """One request of the batch: its params, how many tokens it produced so far (the seed's
    step), whether it wants the chosen token's logprob, how many top alternatives, and its
    grammar state (already caught up with the row's output tokens; None: unconstrained). A step
    with a grammar row must be sampled only after the row's previous token was committed."""

    params: SamplingParams
    step: int = 0
    return_logprob: bool = False
    top_logprobs: int = 0
    grammar: GrammarState | None = None


@dataclass(frozen=True, slots=True)
class SampleOutput:
    token_ids: list[int]
    logprobs: list[float | None]
    top_logprobs: list[TopLogprobs | None]


@dataclass(frozen=True, slots=True)
class ParamsBatch:
    """The sampling parameters of a batch's rows as tensors on the logits' device, built once
    per step from per-request rows (`of_rows`) or straight from a scheduler's arrays.
    `top_k` is the vocabulary size where a row has none; `seeded` lists (row, noise seed) of
    the rows with their own seed (a seeded row's noise seed is keyed by its step)."""

    temperature: torch.Tensor  # [bs] f32, 1.0 on greedy rows
    top_k: torch.Tensor  # [bs] i64
    top_p: torch.Tensor  # [bs] f32
    min_p: torch.Tensor  # [bs] f32
    greedy: torch.Tensor  # [bs] bool
    all_greedy: bool
    any_filter: bool
    seeded: list[tuple[int, int]]

    @classmethod
    def of_rows(cls, rows: Sequence[SampleRow], vocab: int, dev: torch.device) -> ParamsBatch:
        cols = np.array([param_columns(r.params) for r in rows], np.float64)  # [bs, 5]
        seeded = [(i, noise_seed(r.params.seed, r.step)) for i, r in enumerate(rows)
                  if r.params.seed is not None and not r.params.is_greedy]
        return cls.of_columns(cols, vocab, dev, seeded)

    @classmethod
    def of_columns(cls, cols: np.ndarray, vocab: int, dev: torch.device,
                   seeded: list[tuple[int, int]]) -> ParamsBatch:
        """From `param_columns` rows ([bs, 5] f64, a copy this may change) and the seeded
        rows' (row, noise seed)."""
        top_k = cols[:, 1]
        any_filter = bool((top_k > 0).any() or (cols[:, 2] < 1.0).any()
                          or (cols[:, 3] > 0.0).any())
        cols[:, 1] = np.where(top_k > 0, top_k, vocab)
        t = torch.from_numpy(cols).to(dev)  # [bs, 5] f64
        return cls(t[:, 0].float(), t[:, 1].long(), t[:, 2].float(), t[:, 3].float(),
                   t[:, 4].bool(), bool(cols[:, 4].all()), any_filter, seeded)


def param_columns(p: SamplingParams) -> tuple[float, float, float, float, float]:
    """A request's parameters as `ParamsBatch` takes them: (temperature, 1.0 when greedy;
    top_k, 0 for none; top_p; min_p; greedy as 0/1)."""
    greedy = p.is_greedy
    return (1.0 if greedy else p.temperature, p.top_k, p.top_p, p.min_p, float(greedy))


def noise_seed(seed: int, step: int) -> int:
    """The generator seed of a seeded row's noise at its `step`-th token."""
    return (seed * _SEED_MIX + step) % (2**63)


class Sampler:
    """Holds the shared generator of unseeded rows. Not thread-safe (compute thread only)."""

    def __init__(self, device: torch.device | str = "cpu", seed: int | None = None) -> None:
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device)
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, rows: Sequence[SampleRow]) -> SampleOutput:
        """logits: [bs, V] (any float dtype); rows: bs entries, in the same order."""
        logits = logits.float()  # [bs, V]
        greedy = [r.params.is_greedy for r in rows]
        allowed = logits  # [bs, V]: grammar rows' forbidden tokens at -inf (a copy)
        if any(r.grammar is not None for r in rows):
            allowed = mask_logits(logits, [r.grammar for r in rows])
        # all-greedy batches take the argmax path only; chosen: [bs]
        chosen = (allowed.argmax(dim=-1) if all(greedy) else self._sample_batch(
            allowed, ParamsBatch.of_rows(rows, logits.shape[1], logits.device)))
        logprobs, top = _logprobs(logits, chosen, rows)
        return SampleOutput(chosen.tolist(), logprobs, top)

    @torch.inference_mode()
    def choose_batch(self, logits: torch.Tensor, params: ParamsBatch) -> torch.Tensor:
        """The tokens `sample` would choose, [bs] i64 left on the device (no host sync), without
        logprobs: the overlapped decode step feeds them to the next step on the device. The
        parameters come in tensors (the decode batch's own arrays)."""
        logits = logits.float()  # [bs, V]
        return logits.argmax(dim=-1) if params.all_greedy else self._sample_batch(logits, params)

    def _sample_batch(self, logits: torch.Tensor, p: ParamsBatch) -> torch.Tensor:
        probs = torch.softmax(logits / p.temperature[:, None], dim=-1)  # [bs, V]
        noise = self._noise(p.seeded, logits.shape, logits.device)  # [bs, V] Exp(1)
        if p.any_filter:
            sorted_p, sorted_i = probs.sort(dim=-1, descending=True)  # [bs, V] each
            sorted_p = filter_sorted(sorted_p, p)  # [bs, V], renormalized
            # noise stays keyed by token id, so a seeded row draws the same whatever the batch
            pick = (sorted_p / noise.gather(1, sorted_i)).argmax(dim=-1, keepdim=True)  # [bs,1]
            sampled = sorted_i.gather(1, pick)[:, 0]  # [bs]
        else:  # plain temperature sampling: no sort needed
            sampled = (probs / noise).argmax(dim=-1)  # [bs]
        return torch.where(p.greedy, logits.argmax(dim=-1), sampled)  # [bs]

    def _noise(self, seeded: list[tuple[int, int]], shape: torch.Size, dev: torch.device
               ) -> torch.Tensor:
        noise = torch.empty(shape, device=dev)  # [bs, V]
        noise.exponential_(generator=self.generator)
        if seeded:  # every seeded row at once: a hash of (noise seed, token id), no generators
            rows = torch.tensor([i for i, _ in seeded], device=dev)  # [k]
            keys = torch.tensor([k for _, k in seeded], dtype=torch.long, device=dev)  # [k]
            noise[rows] = seeded_noise(keys, shape[1])
        return noise.clamp_(min=1e-20)  # p / 0 would give nan for filtered-out tokens


_M32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finalizer (murmur-style xorshift-multiply rounds) on i64 values below
    2**32; the multipliers are below 2**31, so no product leaves the i64 range."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x5BD1E995) & _M32
    return x ^ (x >> 16)


def seeded_noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """Exp(1) noise [k, vocab] f32 that depends only on each row's noise seed (`keys` [k] i64,
    `noise_seed`) and the token id: counter-based, so a seeded row draws the same whatever the
    batch, on any device, without a generator per row."""
    lo, hi = keys & _M32, (keys >> 32) & _M32  # [k] each
    tok = torch.arange(vocab, device=keys.device)  # [V]
    h = _mix32(_mix32(hi[:, None] ^ _mix32(tok[None, :] + 0x9E3779B)) ^ lo[:, None])  # [k, V]
    u = (h.double() + 0.5) / 4294967296.0  # (0, 1)
    return (-torch.log(u)).float()


def filter_sorted(sorted_p: torch.Tensor, p: ParamsBatch) -> torch.Tensor:
    """Zero the probabilities top-k / top-p / min-p remove (the top token always stays)."""
    rank = torch.arange(sorted_p.shape[1], device=sorted_p.device)[None, :]  # [1, V]
    drop = rank >= p.top_k[:, None]  # [bs, V]
    before = sorted_p.cumsum(dim=-1) - sorted_p  # [bs, V] mass strictly above each token
    drop |= before > p.top_p[:, None]  # top-p: the mass above already reaches top_p
    drop |= sorted_p < (p.min_p * sorted_p[:, 0])[:, None]  # min-p relative to the top token
    drop[:, 0] = False
    kept = sorted_p.masked_fill(drop, 0.0)  # [bs, V]
    return kept / kept.sum(dim=-1, keepdim=True)


def _logprobs(logits: torch.Tensor, chosen: torch.Tensor, rows: Sequence[SampleRow]
              ) -> tuple[list[float | None], list[TopLogprobs | None]]:
    """The chosen tokens' logprobs and the top-N lists, for the rows that asked."""
    max_top = min(max(r.top_logprobs for r in rows), logits.shape[1])
    if not max_top and not any(r.return_logprob for r in rows):
        return [None] * len(rows), [None] * len(rows)
    return logprob_lists(device_logprobs(logits, chosen, max_top),
                         [r.return_logprob for r in rows], [r.top_logprobs for r in rows])


def device_logprobs(logits: torch.Tensor, chosen: torch.Tensor, max_top: int
                    ) -> tuple[torch.Tensor, ...]:
    """Left on the logits' device (no host sync): the chosen tokens' logprobs [bs] f32 under
    the raw distribution (log_softmax of the unscaled logits), and for `max_top` > 0 the
    `max_top` most likely tokens' logprobs and ids [bs, max_top], most likely first."""
    lp_all = torch.log_softmax(logits.float(), dim=-1)  # [bs, V]
    lp = lp_all.gather(1, chosen[:, None])[:, 0]  # [bs]
    if not max_top:
        return (lp,)
    top_v, top_i = lp_all.topk(min(max_top, lp_all.shape[1]), dim=-1)  # [bs, N] each
    return lp, top_v, top_i


def logprob_lists(host: Sequence[torch.Tensor], want: Sequence[bool], tops: Sequence[int]
                  ) -> tuple[list[float | None], list[TopLogprobs | None]]:
    """`device_logprobs`' tensors (on the host) as each row asked: its logprob when `want`,
    its `tops` most likely alternatives when > 0 (None otherwise)."""
    lp = host[0].tolist()
    chosen = [float(v) if w else None for v, w in zip(lp, want, strict=True)]
    if len(host) == 1:
        return chosen, [None] * len(lp)
    ids_all, vals_all = host[2].tolist(), host[1].tolist()
    top: list[TopLogprobs | None] = [
        list(zip(ids[:n], vals[:n], strict=True)) if n else None
        for n, ids, vals in zip(tops, ids_all, vals_all, strict=True)]
    return chosen, top
