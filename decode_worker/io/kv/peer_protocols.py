"""`PeerProtocols`: what each prefill peer speaks, found by probing its bootstrap address.

Per peer "host:port" (`transfer.peer_protocol=auto`; `sglang` probes too, for the server info,
and takes a native answer as a misconfiguration; `native` never probes):

    undecided ──get──► probing ──"sglang" (server info) | "native" (ZMTP greeting)──► decided
        ▲                 │                                                            │
        │                 └──"unreachable" | "foreign"──► a miss: undecided again       │
        └──────────────────────────── forget (the receiver dropped the peer: peer_dead) ┘

Only a peer that answered decides: refused, reset, closed unanswered, silent or a 5xx is a
miss ("unreachable", a request of it ends with peer_dead), and so is an answer from neither
protocol ("foreign", transfer_failed). A miss decides nothing: it answers the callers that were
waiting when it was seen (`since`, on the probe's own clock, not when the owner looked): a
silent peer, when the probe ended (it was silent all along); a refused (reset, closed) one,
when the probe began, as the refusal came at some moment in between and the probe's thread may
report it late: a refusal seen before a restarted peer listened again must not fail a request
sent after. The next caller starts a new probe. A caller waits for the running probe (`get`
returns None), at most `wait_limit_s`. Owner thread only; probes run on `pool`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Literal

from decode_worker.io.kv.sglang.bootstrap_client import Probe

log = logging.getLogger(__name__)

Mode = Literal["auto", "native", "sglang"]
Kind = Literal["native", "sglang", "unavailable"]
ProbeFn = Callable[[str, int, float], Probe]  # (host, port, timeout_s) -> what answers there
Clock = Callable[[], float]
_MAX_MISSES = 4096  # peers whose last probe missed, remembered at once (oldest forgotten)


@dataclasses.dataclass(frozen=True, slots=True)
class PeerProtocol:
    """What a peer speaks; for "sglang" its page size and attention TP size; for
    "unavailable" the abort label its requests end with (`reason`) and why (`detail`)."""

    kind: Kind
    prefill_page_size: int | None = None
    tp_size: int | None = None
    detail: str = ""
    reason: str = "peer_dead"


@dataclasses.dataclass(frozen=True, slots=True)
class Probed:
    """A probe's answer and when it ended and began (the owner's clock, read on the probe's
    thread; `started_at` None: as `ended_at`)."""

    found: Probe
    ended_at: float
    started_at: float | None = None

    @property
    def seen_at(self) -> float:
        """The latest time the answer is known to hold from: the end, or for an instant miss
        (a refusal) the start."""
        if self.found.instant and self.started_at is not None:
            return self.started_at
        return self.ended_at


def timed(probe: ProbeFn, clock: Clock, host: str, port: int, timeout_s: float) -> Probed:
    """Run `probe` (on a pool thread) and stamp its start and end."""
    started_at = clock()
    found = probe(host, port, timeout_s)
    return Probed(found, clock(), started_at)


class PeerProtocols:
    """Decided protocols, running probes and the last miss, by peer (see module doc)."""

    def __init__(self, mode: Mode, probe: ProbeFn, pool: Executor, probe_timeout_s: float,
                 clock: Clock = time.monotonic) -> None:  # fmt: skip
        self.mode, self.probe_timeout_s = mode, probe_timeout_s
        self.wait_limit_s = probe_timeout_s + 1.0  # the probe's own bound, plus its queueing
        self._probe, self._pool, self._clock = probe, pool, clock
        self._known: dict[str, PeerProtocol] = {}
        self._probes: dict[str, Future[Probed]] = {}
        self._misses: dict[str, tuple[float, PeerProtocol]] = {}  # key -> (when, answer)

    def get(self, host: str, port: int, since: float | None = None) -> PeerProtocol | None:
        """The peer's protocol; or the miss of a probe that ended (or of a drop) at or after
        `since` (when the caller began waiting; None: now), an "unavailable" PeerProtocol; or
        None while a probe runs (started here when none runs and no such miss is known)."""
        key, now = f"{host}:{port}", self._clock()
        since = now if since is None else since
        if (proto := self._known.get(key)) is not None and self.mode != "native":
            return proto
        job = self._probes.get(key)
        if job is not None and job.done():
            del self._probes[key]
            proto = self._learn(key, *_result(job, now))
            if proto is not None:
                return proto
            job = None
        miss = self._misses.get(key)
        if miss is not None and miss[0] >= since:
            return miss[1]
        if self.mode == "native":  # never probed: native unless it was just dropped
            return self.known(key)
        if job is None:
            self._probes[key] = self._pool.submit(timed, self._probe, self._clock, host, port,
                                                  self.probe_timeout_s)
        elif now - since > self.wait_limit_s:
            return PeerProtocol("unavailable", detail=f"prefill peer {key} did not answer the "
                                f"protocol probe within {self.wait_limit_s:.1f} s")  # fmt: skip
        return None

    def known(self, key: str) -> PeerProtocol | None:
        """The decided protocol of "host:port", or None (nothing is probed here)."""
        if self.mode == "native":
            return self._known.setdefault(key, PeerProtocol("native"))
        return self._known.get(key)

    def last_miss(self, key: str) -> PeerProtocol | None:
        """The last miss of "host:port" (whatever its age), or None."""
        miss = self._misses.get(key)
        return miss[1] if miss is not None else None

    def forget(self, key: str, detail: str) -> None:
        """The receiver dropped the peer (peer_dead: it died, or restarted): undecided again,
        and a probe still running is cancelled or ignored (it may have seen the old peer; a
        second one may then run beside it for a while). Kept as a miss, for callers that began
        waiting before now (a cancel; a request admitted while the peer was decided). When
        every peer is native only that miss is kept."""
        if (job := self._probes.pop(key, None)) is not None:
            job.cancel()
        if self.mode != "native" and self._known.pop(key, None) is not None:
            log.info("prefill peer %s dropped: its protocol is probed again", key)
        self._miss(key, PeerProtocol("unavailable", detail=f"prefill peer {key} lost: {detail}"))

    def counts(self) -> dict[str, int]:
        """How many decided peers speak each protocol."""
        out = {"native": 0, "sglang": 0}
        for proto in self._known.values():
            out[proto.kind] += 1
        return out

    def _learn(self, key: str, found: Probe, now: float) -> PeerProtocol | None:
        """Decide from a probe's answer (returns the protocol), or record a miss seen at `now`
        (None)."""
        if found.kind == "native" and self.mode == "sglang":
            found = Probe("foreign", detail="answers as a native decode-worker peer, but "
                                            "transfer.peer_protocol is 'sglang'")  # fmt: skip
        if found.kind == "unreachable":
            why = found.detail.removeprefix(f"{key}: ")
            self._miss(key, PeerProtocol("unavailable", detail=f"prefill peer {key} is "
                                         f"unreachable: {why}"), now)  # fmt: skip
            return None
        if found.kind == "foreign":
            self._miss(key, PeerProtocol("unavailable", detail=f"prefill peer {key}: "
                                         f"{found.detail}", reason="transfer_failed"), now)
            return None
        info = found.info
        proto = PeerProtocol(found.kind, info.page_size if info else None,
                             info.attn_tp_size if info else None)  # fmt: skip
        log.info("prefill peer %s speaks %s%s", key, proto.kind, f" (page {proto.prefill_page_size}"
                 f", tp {proto.tp_size})" if info else "")  # fmt: skip
        self._known[key] = proto
        self._misses.pop(key, None)
        return proto

    def _miss(self, key: str, proto: PeerProtocol, now: float | None = None) -> None:
        self._misses.pop(key, None)  # re-inserted last: the dict stays oldest-first
        self._misses[key] = (self._clock() if now is None else now, proto)
        if len(self._misses) > _MAX_MISSES:
            del self._misses[next(iter(self._misses))]


def _result(job: Future[Probed], now: float) -> tuple[Probe, float]:
    """A finished probe's answer and when it was seen (`Probed.seen_at`); one that raised (a
    bug) is unreachable, seen now."""
    try:
        done = job.result()
    except Exception as exc:  # the pool's boundary: a bad address must not stop the engine
        log.exception("protocol probe failed")
        return Probe("unreachable", detail=f"probe failed: {type(exc).__name__}: {exc}"), now
    return done.found, done.seen_at
