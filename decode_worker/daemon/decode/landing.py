"""`LandingDock`: the landing area as the fetcher uses it, for SGLang prefills of a model they lay
out with full KV in every layer (Gemma 3; docs/DEPLOY.md, "Gemma 3 and a stock SGLang prefill").

```
admitted ──► take: room for [P, L) of every layer? ──no──► the request waits (LANDING)
                 │ yes                                      (never fits: it fails, `refusal`)
                 ▼
          submit with landing pages ──► "done"      copy out (full layers, the window), free
                                    └─► "released"  free (nothing to keep)
```
Every page taken is held by exactly one transfer in flight until that transfer's "done" or
"released" (`finish`): a failed, aborted or drained transfer keeps its pages until the peer
stopped writing, as the pool pages do. Compute thread only.
"""

from __future__ import annotations

from decode_worker.core.admission import Admit
from decode_worker.core.landing import LandingBook, LandingPlan
from decode_worker.device.landing import LandingArea


class LandingDock:
    """The landing area's memory (`area`) and books (`book`)."""

    def __init__(self, area: LandingArea, page_size: int) -> None:
        self.area, self.page_size = area, page_size
        self.book = LandingBook(area.num_pages)

    def pages_for(self, admit: Admit) -> int:
        """Landing pages `admit`'s transfer needs: every decode page of [prefix, fill)."""
        return LandingPlan.pages_for(admit.req.fill_len, admit.prefix_len, self.page_size)

    def refusal(self, admit: Admit) -> str | None:
        """Why `admit`'s transfer can never land (more pages than the whole area), or None."""
        need, total = self.pages_for(admit), self.book.num_total
        if need <= total:
            return None
        return (f"its {need * self.page_size} new prompt tokens (of every layer: this model's "
                f"SGLang layout) exceed the landing area of {total * self.page_size} tokens; "
                "raise transfer.sglang_landing_tokens (docs/DEPLOY.md, \"Gemma 3 and a stock "
                "SGLang prefill\")")

    def take(self, admit: Admit, full_dst: list[int]) -> LandingPlan | None:
        """Landing pages for `admit`'s transfer and where they go after (`full_dst`: the full
        pages the peer's KV of [prefix, fill) is for), or None while too few are free."""
        page_ids = self.book.take(self.pages_for(admit))
        if page_ids is None:
            return None
        return LandingPlan.make(page_ids, admit.prefix_len, self.page_size, full_dst,
                                admit.swa_page_ids)

    def hold(self, transfer_id: int, plan: LandingPlan) -> None:
        self.book.hold(transfer_id, plan)

    def give_back(self, plan: LandingPlan) -> None:
        """A plan whose transfer was never submitted."""
        self.book.give_back(list(plan.page_ids))

    def finish(self, transfer_id: int, *, copy: bool) -> None:
        """Transfer `transfer_id` stopped writing: with `copy` (it is done and its request
        goes on) its pages are copied into the pools first; then they are free."""
        plan = self.book.plan_of(transfer_id)
        if plan is None:
            return
        if copy:
            self.area.copy_out(plan)
        self.book.release(transfer_id)
