"""The landing area's books (pure): which landing pages each transfer in flight holds, and where
their KV goes once it has arrived.

A stock SGLang prefill lays out a model such as Gemma 3 as an ordinary one: full KV in every
layer, written for every layer at the same page ids. This worker keeps only the window of the
sliding layers, so such a transfer lands in a bounded landing area (every layer, one landing page
per decode page it sends) and, once it is done, is copied out: the full layers' pages into the
full pool, the window's pages of the sliding layers into the SWA pool; then the landing pages go
back. Map of one transfer (decode pages; P = reused prefix, L = prompt length):

```
decode page   P/ps ............ swa_first ............... cdiv(L, ps) - 1
landing       [ page_ids: every layer of [P, L) .......................... ]
full layers   [ full_dst ............................................... ]
sliding                         [ swa_dst: the window the SWA pool keeps ... ]
```
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from decode_worker.core.pages import PageAllocator
from decode_worker.errors import FatalError, PageError
from decode_worker.utils.mathx import cdiv


@dataclass(frozen=True, slots=True)
class LandingPlan:
    """One transfer's landing pages (`page_ids[i]` holds decode page `first_page + i` of every
    layer) and their destinations: `full_dst[i]` in the full pool for every landing page, and
    `swa_dst[j]` in the SWA pool for landing page `swa_first + j` (the window's pages)."""

    page_ids: tuple[int, ...]
    first_page: int
    full_dst: tuple[int, ...]
    swa_first: int
    swa_dst: tuple[int, ...]

    @staticmethod
    def pages_for(prompt_len: int, reused_len: int, page_size: int) -> int:
        """Landing pages a transfer of `[reused_len, prompt_len)` needs (reused_len aligned)."""
        return cdiv(prompt_len, page_size) - reused_len // page_size

    @classmethod
    def make(cls, page_ids: list[int], reused_len: int, page_size: int, full_dst: list[int],
             swa_dst: list[int]) -> LandingPlan:
        """The plan of landing pages `page_ids` for decode pages from `reused_len // page_size`:
        `full_dst` one full page per landing page, `swa_dst` the SWA pages of the last
        `len(swa_dst)` of them. Raises PageError when the counts do not fit."""
        n = len(page_ids)
        if len(full_dst) != n or len(swa_dst) > n or reused_len % page_size:
            raise PageError(f"landing plan: {n} landing pages for {len(full_dst)} full and "
                            f"{len(swa_dst)} SWA pages (reused_len={reused_len})")
        return cls(tuple(page_ids), reused_len // page_size, tuple(full_dst),
                   n - len(swa_dst), tuple(swa_dst))


class LandingBook:
    """Landing pages `[1, num_pages]` (page 0 is never handed out) and the plan of each
    transfer holding some, by transfer id. Compute thread only."""

    def __init__(self, num_pages: int) -> None:
        self._pages = PageAllocator(num_pages, "landing")
        self._held: dict[int, LandingPlan] = {}

    @property
    def num_total(self) -> int:
        return self._pages.num_total

    @property
    def num_free(self) -> int:
        return self._pages.num_free

    @property
    def num_transfers(self) -> int:
        """Transfers holding landing pages now."""
        return len(self._held)

    def take(self, n: int) -> list[int] | None:
        """`n` landing pages, or None (nothing taken) while fewer are free. Bind them to their
        transfer with `hold` (or hand them back with `give_back`) before the caller returns."""
        return self._pages.alloc(n) if n <= self._pages.num_free else None

    def give_back(self, page_ids: list[int]) -> None:
        """Pages `take` gave that no transfer came to use (its submit failed)."""
        self._pages.free(page_ids)

    def hold(self, transfer_id: int, plan: LandingPlan) -> None:
        """Transfer `transfer_id` holds `plan.page_ids` (taken) until `release`."""
        if transfer_id in self._held:
            raise PageError(f"transfer {transfer_id} holds landing pages already")
        self._held[transfer_id] = plan

    def plan_of(self, transfer_id: int) -> LandingPlan | None:
        return self._held.get(transfer_id)

    def release(self, transfer_id: int) -> LandingPlan | None:
        """The transfer stopped writing: its pages are free again. Its plan (None: it held
        none)."""
        plan = self._held.pop(transfer_id, None)
        if plan is not None:
            self._pages.free(plan.page_ids)
        return plan

    def check_integrity(self, in_flight: Collection[int]) -> None:
        """Every page held is held by exactly one transfer, and every holder is `in_flight`
        (a transfer that has not reported its end). Raises FatalError."""
        self._pages.check_integrity()
        pages = [p for plan in self._held.values() for p in plan.page_ids]
        if len(set(pages)) != len(pages) or not self._pages.all_held(pages):
            raise FatalError("landing pages: a page is held twice, or held but free")
        if len(pages) != self.num_total - self.num_free:
            raise FatalError(f"landing pages: {self.num_total - self.num_free} taken, "
                             f"{len(pages)} held by transfers")
        gone = sorted(set(self._held) - set(in_flight))
        if gone:
            raise FatalError(f"landing pages held by transfers no longer in flight: {gone}")
