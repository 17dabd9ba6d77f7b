"""Which drafted tokens a verify step keeps: greedy by comparison, sampled by rejection.

A verify step ran each request's input token and its k drafts as consecutive entries; entry
`start + j` holds the model's distribution of the token after draft j - 1 (j = 0: after the
input token). Request i's drafts x_0 .. x_{k-1} are checked in order against entries
start .. start + k - 1, and one more token (the bonus) always comes from the entry after the
last kept draft:
```
entries:  start      start+1    ...  start+k-1   start+k
checks:   x_0        x_1        ...  x_{k-1}     (bonus when all k are kept)
```
- A greedy request keeps x_j while it is the argmax; the bonus is the argmax where it stopped.
- A sampled request keeps x_j with probability p_j(x_j) (p: the distribution after temperature,
  top-k, top-p and min-p); at the first refusal its bonus is drawn from p_j without x_j,
  renormalised; when all are kept, from p_k. A draft is a point mass, so this is speculative
  sampling's rule min(1, p/q) with q = 1, and every token is distributed exactly as when decoding
  without drafts (Leviathan et al. 2023, Chen et al. 2023).
Everything runs on the logits' device; one copy of the decisions comes to the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from decode_worker.device.sampler import ParamsBatch, filter_sorted, seeded_noise


@dataclass(frozen=True, slots=True)
class Drafts:
    """A verify step's drafts: request i's entries are `starts[i]` .. `starts[i] + ks[i]`,
    its drafts `tokens[offsets[i]:offsets[i] + ks[i]]`."""

    starts: np.ndarray  # [n] i64
    ks: np.ndarray  # [n] i64
    tokens: np.ndarray  # [D] i64, D = ks.sum()

    @classmethod
    def of(cls, drafts: list[list[int]]) -> Drafts:
        ks = np.fromiter((len(d) for d in drafts), np.int64, len(drafts))
        starts = np.concatenate(([0], np.cumsum(ks + 1)[:-1])).astype(np.int64)
        tokens = np.fromiter((t for d in drafts for t in d), np.int64, int(ks.sum()))
        return cls(starts, ks, tokens)

    @property
    def num_entries(self) -> int:
        return int((self.ks + 1).sum())

    def draft_entries(self) -> np.ndarray:
        """[D] the entry that checks each draft (its request's start + its index)."""
        first = np.repeat(self.starts, self.ks)  # [D]
        within = np.arange(len(self.tokens)) - np.repeat(np.cumsum(self.ks) - self.ks, self.ks)
        return first + within

    def input_entries(self) -> np.ndarray:
        """[D] the entries whose input token is a draft (each draft's entry + 1)."""
        return self.draft_entries() + 1


def probabilities(logits: torch.Tensor, params: ParamsBatch) -> torch.Tensor:
    """[T, V] f32: each entry's distribution after temperature and the filters; a one-hot at
    the argmax on greedy entries."""
    logits = logits.float()
    probs = torch.softmax(logits / params.temperature[:, None], dim=-1)  # [T, V]
    if params.any_filter:
        sorted_p, sorted_i = probs.sort(dim=-1, descending=True)  # [T, V] each
        probs = torch.zeros_like(probs).scatter_(1, sorted_i, filter_sorted(sorted_p, params))
    if bool(params.greedy.any()):
        hot = torch.zeros_like(probs).scatter_(1, logits.argmax(-1, keepdim=True), 1.0)
        probs = torch.where(params.greedy[:, None], hot, probs)  # [T, V]
    return probs


def accept(logits: torch.Tensor, params: ParamsBatch, drafts: Drafts,
           generator: torch.Generator, seeds: np.ndarray | None = None) -> list[list[int]]:
    """Each request's run: its kept drafts then the bonus token (1 .. k + 1 tokens).

    `params` holds one row per entry ([T]); `seeds` ([T] i64, -1: none) gives a seeded entry
    its own noise, keyed by the token it draws, so seeded requests repeat whatever the batch."""
    if params.all_greedy:
        return _accept_greedy(logits.argmax(-1).cpu().numpy(), drafts)
    dev = logits.device
    probs = probabilities(logits, params)  # [T, V]
    d_entries = torch.from_numpy(drafts.draft_entries()).to(dev)  # [D]
    d_tokens = torch.from_numpy(drafts.tokens).to(dev)  # [D]
    p_draft = probs[d_entries, d_tokens]  # [D]
    u = torch.rand(len(drafts.tokens), generator=generator, device=dev)  # [D]
    if seeds is not None and (seeds >= 0).any():
        u = _seeded_uniform(u, seeds, drafts, dev)
    kept = (u < p_draft).cpu().numpy()  # [D] bool
    num_kept = _first_refusal(kept, drafts.ks)  # [n]
    # the bonus: from the entry after the kept drafts, the refused draft taken out
    b_entries = drafts.starts + num_kept  # [n]
    offsets = np.cumsum(drafts.ks) - drafts.ks  # [n]
    refused = np.flatnonzero(num_kept < drafts.ks)  # requests that refused a draft
    bonus_p = probs[torch.from_numpy(b_entries).to(dev)]  # [n, V]
    if len(refused):
        out_tok = drafts.tokens[offsets[refused] + num_kept[refused]]  # [r]
        bonus_p[torch.from_numpy(refused).to(dev), torch.from_numpy(out_tok).to(dev)] = 0.0
    bonus = _draw(bonus_p, generator, seeds[b_entries] if seeds is not None else None, dev)
    bonus_host = bonus.cpu().tolist()
    return [[*drafts.tokens[o:o + int(a)].tolist(), b] for o, a, b in
            zip(offsets.tolist(), num_kept.tolist(), bonus_host, strict=True)]


def _accept_greedy(targets: np.ndarray, drafts: Drafts) -> list[list[int]]:
    """targets: [T] the argmax of every entry."""
    checks = targets[drafts.draft_entries()]  # [D]
    num_kept = _first_refusal(checks == drafts.tokens, drafts.ks)  # [n]
    offsets = np.cumsum(drafts.ks) - drafts.ks
    bonus = targets[drafts.starts + num_kept]  # [n]
    return [[*drafts.tokens[o:o + int(a)].tolist(), int(b)] for o, a, b in
            zip(offsets.tolist(), num_kept.tolist(), bonus.tolist(), strict=True)]


def _first_refusal(kept: np.ndarray, ks: np.ndarray) -> np.ndarray:
    """[n]: how many drafts each request keeps (its leading run of `kept`)."""
    out = np.empty(len(ks), np.int64)
    o = 0
    for i, k in enumerate(ks.tolist()):
        run = kept[o:o + k]
        bad = np.flatnonzero(~run)
        out[i] = bad[0] if len(bad) else k
        o += k
    return out


def _draw(probs: torch.Tensor, generator: torch.Generator, seeds: np.ndarray | None,
          dev: torch.device) -> torch.Tensor:
    """One token per row of `probs` ([n, V], not necessarily normalised): the exponential race
    (argmax p / E, E ~ Exp(1)) draws exactly from p / sum(p)."""
    noise = torch.empty(probs.shape, device=dev)  # [n, V]
    noise.exponential_(generator=generator)
    if seeds is not None and (seeds >= 0).any():
        rows = np.flatnonzero(seeds >= 0)
        keys = torch.from_numpy(seeds[rows]).to(dev) ^ 0x5BD1E995  # [r] a bonus draw's stream
        noise[torch.from_numpy(rows).to(dev)] = seeded_noise(keys, probs.shape[1])
    return (probs / noise.clamp_(min=1e-20)).argmax(-1)  # [n]


def _seeded_uniform(u: torch.Tensor, seeds: np.ndarray, drafts: Drafts,
                    dev: torch.device) -> torch.Tensor:
    """Seeded entries' acceptance draws from their own key: U = exp(-E), E ~ Exp(1) by key."""
    key = seeds[drafts.draft_entries()]  # [D]
    rows = np.flatnonzero(key >= 0)
    if len(rows):
        e = seeded_noise(torch.from_numpy(key[rows]).to(dev), 1)[:, 0]  # [r]
        u[torch.from_numpy(rows).to(dev)] = torch.exp(-e)
    return u
