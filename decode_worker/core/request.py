"""The decode-side request and its state machine (pure; times are passed in, no clocks).

```
QUEUED --> RESERVED --> RECEIVING --> READY --> RUNNING --> FINISHED
   ^          +-------------------------->^          |
   |            (transfer done in one poll)          v
   +-------------------------------------------- RETRACTED
any non-terminal state --> ABORTED | FAILED (with a reason)
```
What each state holds: QUEUED and RETRACTED hold no pages; RESERVED, RECEIVING, READY and RUNNING
hold `kv` (request-owned pages plus a lock on a tree prefix). Every transition goes through
`DecodeRequest.transition`, which releases what the old state held when the new one holds none.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

from decode_worker.core.radix_node import PageKey, page_keys
from decode_worker.core.req_kv import ReqKV
from decode_worker.errors import InvalidTransition


class RequestState(enum.Enum):
    QUEUED = "queued"  # in the prealloc queue, holds nothing
    RESERVED = "reserved"  # pages reserved, transfer requested
    RECEIVING = "receiving"  # the peer accepted the transfer; KV arriving
    READY = "ready"  # KV and the first token arrived, not yet in the decode batch
    RUNNING = "running"  # in the decode batch; prompt inserted into the tree
    RETRACTED = "retracted"  # taken out of the batch for pages; computed KV cached; requeued
    FINISHED = "finished"
    ABORTED = "aborted"
    FAILED = "failed"

    __hash__ = object.__hash__  # members are singletons; Enum's hashes the name in Python


S = RequestState
TERMINAL = frozenset({S.FINISHED, S.ABORTED, S.FAILED})
HOLDS_KV = frozenset({S.RESERVED, S.RECEIVING, S.READY, S.RUNNING})
_END = frozenset({S.ABORTED, S.FAILED})
_ALLOWED: dict[RequestState, frozenset[RequestState]] = {
    S.QUEUED: frozenset({S.RESERVED}) | _END,
    S.RESERVED: frozenset({S.RECEIVING, S.READY}) | _END,
    S.RECEIVING: frozenset({S.READY}) | _END,
    S.READY: frozenset({S.RUNNING}) | _END,
    S.RUNNING: frozenset({S.FINISHED, S.RETRACTED}) | _END,
    S.RETRACTED: frozenset({S.QUEUED}) | _END,
    S.FINISHED: frozenset(),
    S.ABORTED: frozenset(),
    S.FAILED: frozenset(),
}


class KVKeeper(Protocol):
    """Where a request's `ReqKV` goes when its state changes; the one implementation is
    `core.kv_context.KVContext`."""

    def cache_unfinished(self, kv: ReqKV) -> None:
        """The request starts running: its received prompt KV enters the tree (the one place a
        prompt enters the cache), its lock moving onto it. Nothing without a tree."""

    def release(self, kv: ReqKV, *, insert: bool) -> None:
        """Give back everything `kv` holds; with `insert`, the tree keeps its page-aligned KV
        (valid KV only). Empties `kv`'s page tables."""


@dataclass(slots=True, eq=False)
class DecodeRequest:
    """One generation request on the decode side.

    `prompt_ids` never change; `output_ids` grow by one per step. The KV the request must hold
    covers `fill_ids` = prompt + every output token but the last (the last one is the next
    step's input). `entered_at[state]` is the `now` at which it last entered that state.
    `key_cache` holds the page keys of `fill_ids` built so far (`page_keys`): because the
    token sequence only grows, keys are built once and extended, never rebuilt.
    """

    rid: str
    room: int
    prompt_ids: list[int]
    max_new_tokens: int
    output_ids: list[int] = field(default_factory=list)
    state: RequestState = S.QUEUED
    kv: ReqKV | None = None
    reason: str = ""  # abort/fail label (docs/CONTRACTS.md abort reasons)
    message: str = ""  # human-readable cause, for the client and the log
    num_retractions: int = 0
    entered_at: dict[RequestState, float] = field(default_factory=dict)
    sglang_page_size: int = 0  # its KV comes from an SGLang prefill of this page size (0: not)
    key_cache: list[PageKey] = field(default_factory=list, repr=False)
    key_page_size: int = field(default=0, repr=False)  # the page size of `key_cache` (0: none)

    @property
    def fill_len(self) -> int:
        """Tokens whose KV must be present before the next step."""
        return len(self.prompt_ids) + max(len(self.output_ids) - 1, 0)

    @property
    def fill_ids(self) -> list[int]:
        """Token ids of `fill_len` (what prefill is asked to provide KV for)."""
        return self.prompt_ids + self.output_ids[:-1]

    def kv_tokens(self) -> tuple[list[int], bool]:
        """The token list a new `ReqKV` starts from and whether it is shared: `prompt_ids`
        itself while `fill_ids` is just the prompt (`ReqKV.shares_tokens`), else a copy."""
        if len(self.output_ids) <= 1:
            return self.prompt_ids, True
        return self.fill_ids, False

    def page_keys(self, page_size: int) -> list[PageKey]:
        """Page keys of the page-aligned prefix of `fill_ids` (the cached list itself: do not
        mutate it). Only pages completed since the last call are built, from one packed buffer
        of the new tokens, so a request that waits in the queue costs nothing here per pass."""
        keys = self.key_cache
        if page_size != self.key_page_size:
            keys.clear()
            self.key_page_size = page_size
        n = self.fill_len // page_size
        have = len(keys)
        if have < n:
            lo, hi, prompt = have * page_size, n * page_size, self.prompt_ids
            np_ = len(prompt)
            if lo == 0 and hi <= np_:
                new = prompt  # the first build: `page_keys` drops the partial page, no copy
            elif hi <= np_:
                new = prompt[lo:hi]
            else:
                new = prompt[lo:] + self.output_ids[max(0, lo - np_) : hi - np_]
            keys += page_keys(new, page_size)
        return keys

    @property
    def is_resumed(self) -> bool:
        """A retracted request readmitted: its next input is `output_ids[-1]`, not a token
        from the transfer (the shell replays it)."""
        return bool(self.output_ids)

    @property
    def is_done(self) -> bool:
        return self.state in TERMINAL

    def transition(
        self,
        to: RequestState,
        now: float,
        *,
        kv: ReqKV | None = None,
        keeper: KVKeeper | None = None,
        first_token: int | None = None,
        reason: str = "",
        message: str = "",
    ) -> None:
        """Move to `to`; the one place a request changes state.

        - to RESERVED: `kv` (the reserved pages and prefix lock) is required and taken over.
        - to READY (its KV arrived): `first_token`, the prefill's first output token, is its
          first output; a resumed request keeps its own last token and ignores it (required
          for a request without output).
        - to RUNNING: `keeper` is required; the received prompt enters the tree.
        - leaving a state that holds KV for one that holds none: `keeper` is required; the KV
          is inserted into the tree when it is valid (FINISHED, RETRACTED, or ABORTED after it
          arrived) and freed otherwise (FAILED, ABORTED before arrival).
        - to ABORTED / FAILED: `reason` is the label, `message` the cause.
        Raises `InvalidTransition` (nothing changed) for a transition the state machine lacks
        or a missing argument.
        """
        if to not in _ALLOWED[self.state]:
            raise InvalidTransition(f"req={self.rid}: {self.state.value} -> {to.value}")
        drops_kv = self.state in HOLDS_KV and to not in HOLDS_KV
        if to is S.RESERVED and kv is None:
            raise InvalidTransition(f"req={self.rid}: -> reserved needs the reserved kv")
        if to is S.READY and first_token is None and not self.output_ids:
            raise InvalidTransition(f"req={self.rid}: -> ready needs the first token")
        if (drops_kv or to is S.RUNNING) and keeper is None:
            raise InvalidTransition(f"req={self.rid}: {self.state.value} -> {to.value} "
                                    "needs the keeper of the kv it holds")
        if drops_kv and self.kv is not None and keeper is not None:
            insert = to in (S.FINISHED, S.RETRACTED) or (
                to is S.ABORTED and self.state in (S.READY, S.RUNNING)
            )
            keeper.release(self.kv, insert=insert)
            self.kv = None
        if to is S.RUNNING and self.kv is not None and keeper is not None:
            keeper.cache_unfinished(self.kv)
        if to is S.READY and not self.output_ids:
            self.output_ids.append(first_token)  # type: ignore[arg-type]  # checked above
        if to is S.RESERVED:
            self.kv = kv
        if to is S.RETRACTED:
            self.num_retractions += 1
        if to in _END:
            self.reason, self.message = reason, message or reason
        self.state = to
        self.entered_at[to] = now


class StepCommit:
    """The one way decode steps are committed: over a set of RUNNING requests (a batch's
    members, checked once when it is built), each step gives every request n >= 1 tokens.

    A step of request i ran its input token (its last output token) and, for n > 1, the
    first n - 1 tokens of its run (verified drafts), at positions `kv.seq_len` onwards; all n
    are output tokens, and the KV of all but the last is now held:
    ```
    before:  kv.token_ids = [.. t_k-1]           output_ids = [.. t_k]
    run r:   kv.token_ids += [t_k] + r[:-1]      output_ids += r
    ```
    Built once per membership (the lists are cached: a step costs two appends per request);
    valid while every member stays RUNNING, i.e. until the batch's membership changes. Raises
    `InvalidTransition` at build for a request that is not RUNNING with a next input.
    """

    __slots__ = ("_kv_tokens", "_outputs", "reqs")

    def __init__(self, reqs: list[DecodeRequest]) -> None:
        for r in reqs:
            kv = r.kv
            if r.state is not S.RUNNING or kv is None or not r.output_ids:
                raise InvalidTransition(f"req={r.rid}: commit in {r.state.value}")
            if kv.shares_tokens:  # appends go to the list directly: it must be its own
                kv.token_ids, kv.shares_tokens = kv.token_ids[:], False
        self.reqs = reqs
        self._outputs = [r.output_ids for r in reqs]
        self._kv_tokens = [r.kv.token_ids for r in reqs]  # type: ignore[union-attr]

    def subset(self, keep: list[bool]) -> StepCommit:
        """The members where `keep` is set (no new check: they are members still)."""
        out = StepCommit.__new__(StepCommit)
        out.reqs = list(itertools.compress(self.reqs, keep))
        out._outputs = list(itertools.compress(self._outputs, keep))
        out._kv_tokens = list(itertools.compress(self._kv_tokens, keep))
        return out

    def last_tokens(self) -> list[int]:
        """Each member's last output token (the next step's input)."""
        return [out[-1] for out in self._outputs]

    def commit(self, token_ids: list[int]) -> None:
        """One token per member (`token_ids[i]` for member i): the n = 1 step."""
        for output, kv_tokens, token in zip(self._outputs, self._kv_tokens, token_ids,
                                            strict=True):
            kv_tokens.append(output[-1])
            output.append(token)

    def commit_runs(self, runs: list[list[int]]) -> None:
        """`runs[i]` (n >= 1 tokens) for member i: see the class."""
        for output, kv_tokens, run in zip(self._outputs, self._kv_tokens, runs, strict=True):
            if not run:
                raise InvalidTransition("commit_runs: an empty run")
            kv_tokens.append(output[-1])
            kv_tokens += run[:-1]
            output += run


def held_page_ids(
    reqs: Iterable[DecodeRequest], page_size: int
) -> tuple[list[int], list[int]]:
    """Full and SWA pages the requests own (not the tree's): for `check_integrity`."""
    full: list[int] = []
    swa: list[int] = []
    for r in reqs:
        if r.kv is not None:
            full += r.kv.owned_full_page_ids(page_size)
            swa += r.kv.owned_swa_page_ids(page_size)
    return full, swa
