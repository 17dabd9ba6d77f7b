"""What both drafters share: the requests' own tokens, the shared memory, deferred work.

Each request's tokens (prompt, then what it accepts) live in its own `TokenArena`; finished
requests go to one shared arena, and with a `LiveIndex` (NGRAM) the live requests' grams are
published for the others to draft from (see live.py). Indexing is the costly part, so it
waits for `flush()`: the decode step calls it where it costs nothing (while the verify
forward runs on the device),
and `propose` stays correct without it (searches scan what is not indexed yet, and a request
with more than `MAX_PENDING` tokens waiting is indexed first). What the other live requests
see changes only at `flush`, so proposing twice gives the same drafts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Generic, TypeVar

from decode_worker.core.spec.arena import MAX_PENDING, TokenArena
from decode_worker.core.spec.drafter import DrafterStats
from decode_worker.core.spec.live import LiveIndex
from decode_worker.errors import InvalidTransition

FLUSH_BATCH = 64  # a request's waiting tokens indexed together
# requests due at one flush are indexed over this many flushes (most waiting first), at least
# FLUSH_SPREAD_MIN a flush: a batch that accepts together (its first wave, or every request's
# tokens at once after the policy's quiet steps) would otherwise index batch x FLUSH_BATCH
# tokens in one flush, longer than a short forward that should hide it
FLUSH_SPREAD, FLUSH_SPREAD_MIN = 4, 8


class ReqState:
    """One request's drafting state: its own tokens (prompt + accepted output); with a live
    index, its start order (`seq`), whether it still runs, and how far the other requests
    see its tokens (`shown`: the positions indexed at its last flush)."""

    __slots__ = ("alive", "own", "prompt_len", "seq", "shown")

    def __init__(self, own: TokenArena, prompt_len: int) -> None:
        self.own = own
        self.prompt_len = prompt_len
        self.seq = 0
        self.alive = True
        self.shown = 0


R = TypeVar("R", bound=ReqState)


class DrafterBase(Generic[R]):
    """Request bookkeeping and deferred work; subclasses draft (see `Drafter`)."""

    def __init__(self, anchors: tuple[int, ...], shared: TokenArena | None, k_max: int,
                 live: bool = False) -> None:
        self.anchors = anchors
        self.k_max = k_max  # the most tokens a draft has
        self.shared = shared
        self.live = LiveIndex(anchors[0]) if live else None
        self._started = 0  # requests started so far: the next one's `seq`
        self._ended: list[R] = []  # finished, still in the live index until `flush`
        self.shared_version = 0  # bumped whenever the shared memory gains a sequence
        self._reqs: dict[str, R] = {}
        self._dirty: set[str] = set()  # requests with tokens not indexed yet
        self._stored: list[list[int]] = []  # finished sequences waiting for `flush`

    def new_req(self, own: TokenArena, prompt_len: int) -> R:
        raise NotImplementedError

    def draft(self, r: R, k: int) -> list[int]:
        """Request `r`'s draft of at most k >= 1 tokens."""
        raise NotImplementedError

    def propose(self, rids: Sequence[str], max_tokens: Sequence[int]) -> list[list[int]]:
        drafts: list[list[int]] = []
        for rid, k in zip(rids, max_tokens, strict=True):
            r = self.req(rid)
            k = min(k, self.k_max)
            drafts.append(self.draft(r, k) if k > 0 else [])
        return drafts

    def stored_tokens(self, r: R) -> list[int]:
        """What a finished request leaves in the shared memory."""
        raise NotImplementedError

    def start(self, rid: str, prompt_ids: Sequence[int], output_ids: Sequence[int] = ()) -> None:
        if rid in self._reqs:
            raise InvalidTransition(f"req={rid}: drafting already started")
        own = TokenArena(self.anchors, track_new=self.live is not None)
        own.extend(prompt_ids)
        own.extend(output_ids)
        r = self._reqs[rid] = self.new_req(own, len(prompt_ids))
        self._started += 1
        r.seq = self._started
        self._dirty.add(rid)

    def finish(self, rid: str, keep: bool = True) -> None:
        r = self._reqs.pop(rid, None)
        self._dirty.discard(rid)
        if r is not None and self.live is not None:
            r.alive = False  # no longer drafted from; withdrawn at `flush`
            self._ended.append(r)
        if r is not None and keep and self.shared is not None:
            tokens = self.stored_tokens(r)
            if tokens:
                self._stored.append(tokens)

    def flush(self) -> None:
        """Index what requests started or accepted since the last flush (once at least
        `FLUSH_BATCH` tokens wait: a call per few tokens costs more than their indexing;
        many such requests at once over `FLUSH_SPREAD` flushes) and store finished requests
        in the shared memory (until then they are not drafted from). With a live index: a
        request's first index takes all it has (its prompt becomes visible to the others),
        indexed tokens are published, ended requests withdrawn."""
        done, live = [], self.live
        # fewer than FLUSH_BATCH waiting: not worth a call, the scan is cheap
        due = [r for rid in self._dirty if (r := self._reqs[rid]).own.pending >= FLUSH_BATCH
               or (live is not None and r.own.indexed == 0)]
        if len(due) > FLUSH_SPREAD_MIN:
            due.sort(key=lambda r: r.own.pending, reverse=True)
            del due[max(FLUSH_SPREAD_MIN, -(-len(due) // FLUSH_SPREAD)):]
        for r in due:
            r.own.index()
        for rid in self._dirty:
            r = self._reqs[rid]
            own = r.own
            if live is not None and own.indexed > r.shown:
                assert own.new_keys is not None
                live.publish(r, own.new_keys)
                own.new_keys.clear()
                r.shown = own.indexed
            if own.pending == 0:
                done.append(rid)
        self._dirty.difference_update(done)
        if live is not None and self._ended:
            for r in self._ended:
                live.withdraw(r)
            self._ended.clear()
        if self.shared is not None and self._stored:
            for tokens in self._stored:
                self.shared.add_sequence(tokens)
            self.shared_version += 1
        self._stored.clear()

    def stats(self) -> DrafterStats:
        s = self.shared
        return DrafterStats(len(self._reqs), 0 if s is None else len(s.sequences),
                            0 if s is None else s.num_live_tokens)

    def check_integrity(self) -> None:
        if self.shared is not None:
            self.shared.check_integrity()
        for rid, r in self._reqs.items():
            r.own.check_integrity()
            assert rid in self._dirty or r.own.pending == 0, f"req={rid}: unindexed, not dirty"
            assert rid in self._dirty or self.live is None or r.shown == r.own.indexed, (
                f"req={rid}: unpublished, not dirty")
        if self.live is not None:
            self.live.check_integrity(self._reqs.values(), self._ended)

    def req(self, rid: str) -> R:
        r = self._reqs.get(rid)
        if r is None:
            raise InvalidTransition(f"req={rid}: drafting not started")
        return r

    def appended(self, rid: str, r: R, token_ids: list[int]) -> None:
        """Append accepted tokens to the request's own arena (indexed at `flush`)."""
        own = r.own
        own.tokens += token_ids
        if len(own.tokens) + own.base - own.indexed > MAX_PENDING:
            own.index()  # published at the next flush
        self._dirty.add(rid)


def searchable(own: TokenArena) -> TokenArena:
    """A request's own arena, with few enough tokens waiting to scan them (a request started
    and searched before any `flush` is indexed here)."""
    if own.pending > MAX_PENDING:
        own.index()
    return own
