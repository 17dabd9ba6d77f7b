"""The reference prefill peer: ZMQ bootstrap server + one compute thread.

Each room needs two halves, which may arrive in either order: the prompt (from this peer's own
HTTP /generate, `add_prompt`, or the `prompt_ids` of the transfer request) and the decode side's
`TransferRequest`. When both are in, the compute thread prefills the prompt into this peer's own
pools, writes the first token into an aux row, WRITEs the requested pages (full `[P, L)`, SWA
`[S, L)`) and the aux row into the decode side, waits for the WRITEs, then answers
`TransferDone` (or `TransferFailed`). Unmatched halves expire after `match_timeout_s`.

Threads: the bootstrap thread runs `_on_message`; the compute thread owns torch, the pools and
the page free lists (the pipeline of `push.PushPipeline`); `_lock` guards the matching
tables shared by both.
"""

from __future__ import annotations

import logging
import time

from decode_worker.core.sampling import SamplingParams
from decode_worker.daemon.prefill.push import PushPipeline
from decode_worker.daemon.prefill.shell import PeerShell
from decode_worker.daemon.prefill.state import Decoder, Half, Job, Matcher, OnDone, PrefillResult
from decode_worker.daemon.shared.compat import model_compat, region_layouts
from decode_worker.device.aux_buffer import AuxBuffer
from decode_worker.device.runner import ModelRunner
from decode_worker.errors import DecodeWorkerError, PageError, TransferError
from decode_worker.io.kv import protocol as p
from decode_worker.io.kv.bootstrap import BootstrapServer
from decode_worker.io.kv.protocol_check import check_compat, validate_request
from decode_worker.io.metrics import Metrics
from decode_worker.settings import TransferSettings

log = logging.getLogger(__name__)
DECODE_SILENT_S = 10.0  # a decode peer silent this long (at least) is judged gone


class PrefillPeer(PeerShell[Job]):
    """Serve prefill-and-push on `settings.bootstrap_host:bootstrap_port` until `close()`.

    Raises TransferError if the port cannot be bound, ConfigError if NIXL cannot start.
    """

    server: BootstrapServer
    _push: PushPipeline

    def __init__(
        self, runner: ModelRunner, settings: TransferSettings, model_name: str,
        num_aux_rows: int = 256, match_timeout_s: float = 60.0, metrics: Metrics | None = None,
    ) -> None:  # fmt: skip
        self.compat = model_compat(runner, model_name)
        self.aux = AuxBuffer(num_aux_rows)
        self.regions = region_layouts(runner.pools, self.aux)
        super().__init__(runner, settings)
        self.metrics = metrics
        self.agent.register([*runner.pools.memory_regions(), self.aux.memory_region()])
        self._push = PushPipeline(runner, self.aux, self.regions, self.agent, self._finish)
        self._decoders: dict[bytes, Decoder] = {}
        self._matcher = Matcher(match_timeout_s)
        self.server = BootstrapServer(
            settings.bootstrap_host, settings.bootstrap_port, self._on_message
        )
        self._serve()

    # -- the two halves (`add_prompt`: PeerShell) --------------------------------------------

    def _add_prompt(self, room: int, token_ids: list[int], on_done: OnDone | None,
                    sampling: SamplingParams | None) -> None:
        with self._lock:
            refused = self._matcher.take_cancelled(room)
            job = None if refused is not None else self._matcher.add_prompt(
                room, token_ids, on_done, time.monotonic(), sampling)
            displaced = self._matcher.take_displaced()
        if refused is not None:  # the decode side ended this room before its prompt came
            if on_done is not None:
                on_done(refused)
            return
        self._fail_halves(displaced, "replaced by a newer request for the same room")
        if job is not None:
            self._jobs.put(job)

    def _on_message(self, peer: bytes, msg: p.Message) -> list[p.Message]:
        now = time.monotonic()
        with self._lock:
            if (dec := self._decoders.get(peer)) is not None:
                dec.last_seen = now
        if isinstance(msg, p.Abort) and msg.reason:  # the decode side ended the room's request
            self._cancel(msg, now)
            if msg.transfer_id == 0:
                return []
        if dec is None and not isinstance(msg, p.Hello):
            # A peer we never greeted (we restarted): it drops us and handshakes again.
            return [p.Refused("no handshake from this peer (the prefill peer restarted?)")]
        match msg:
            case p.Hello():
                return [self._hello(peer, msg, now)]
            case p.Ping(seq=seq):
                return [p.Pong(seq)]
            case p.TransferRequest():
                return self._transfer_request(peer, msg, now)
            case p.Abort(transfer_id=tid, room=room):
                with self._lock:
                    acked = self._matcher.abort(peer, tid)
                return [p.AbortAck(tid, room)] if acked else []
        return [p.Refused(f"unexpected {type(msg).__name__}")]

    def _cancel(self, msg: p.Abort, now: float) -> None:
        """Answer the HTTP side of `msg.room` with the decode side's reason (now, or when its
        prompt comes); a room that ran already is ignored. Counted by outcome."""
        answer = PrefillResult(msg.room, None, 0.0, 0, f"the decode worker ended this request "
                               f"({msg.reason}): {msg.detail}", error_code=msg.reason)
        with self._lock:
            outcome, on_done = self._matcher.cancel(msg.room, answer, now)
        log.info("room %d: the decode side ended it (%s): %s", msg.room, msg.reason, outcome)
        if self.metrics is not None:
            self.metrics.inc_decode_abort(outcome)
        if on_done is not None:
            on_done(answer)

    def _hello(self, peer: bytes, msg: p.Hello, now: float) -> p.Message:
        try:
            check_compat(msg.compat, self.compat, msg.version)
            regions: dict[str, p.RegionLayout] = {r.name: r for r in msg.regions}
            if set(regions) != {"full", "swa", "aux"}:
                raise TransferError(f"regions {sorted(regions)}: need full, swa and aux")
            name = self.agent.add_peer(msg.agent_metadata)
        except TransferError as exc:
            log.warning("refused decode peer %s: %s", msg.agent_name, exc)
            return p.Refused(str(exc))
        with self._lock:
            self._decoders[peer] = Decoder(name, regions, now)
        log.info("decode peer %s connected", name)
        return p.Welcome(p.PROTOCOL_VERSION, self.compat, self.agent.name,
                         self.settings.heartbeat_interval_s)  # fmt: skip

    def _transfer_request(self, peer: bytes, req: p.TransferRequest, now: float) -> list[p.Message]:
        with self._lock:
            dec = self._decoders.get(peer)
        try:
            if dec is None:
                raise TransferError("no handshake from this peer")
            validate_request(req, self.compat.page_size, dec.regions)
        except (TransferError, PageError) as exc:  # a decode side that skipped its own check
            return [p.TransferFailed(req.transfer_id, req.room, str(exc))]
        with self._lock:
            dec.rooms.add(req.room)
            job = self._matcher.add_request(peer, req, now)
            displaced = self._matcher.take_displaced()
        self._fail_halves(displaced, "replaced by a newer transfer request for the same room")
        if job is not None:
            self._jobs.put(job)
        return []

    # -- compute thread ----------------------------------------------------------------------

    def _start(self, job: Job) -> None:
        req = job.req
        with self._lock:
            dec = self._decoders.get(job.peer)
            aborted = self._matcher.is_aborted(job)
        try:
            if aborted:  # aborted while queued: skip the work, `_finish` acks
                raise TransferError("aborted by the decode peer before it started")
            if dec is None:
                raise TransferError("decode peer went away")
            if len(job.prompt) != req.prompt_len:
                raise TransferError(
                    f"prompt has {len(job.prompt)} tokens, request says {req.prompt_len}"
                )
            self._push.post(job, dec)
        except DecodeWorkerError as exc:
            self._finish(job, PrefillResult(req.room, None, 0.0, 0, str(exc)))

    def _finish(
        self, job: Job, result: PrefillResult, done: p.TransferDone | None = None
    ) -> None:
        """Answer the decode peer (`done` once the WRITEs landed, failure, abort ack) and the
        HTTP side for one job."""
        req = job.req
        if done is not None:
            self.server.send(job.peer, done)
        if result.error is not None:
            log.warning("room %d rid=%s: %s", req.room, req.rid, result.error)
            self.server.send(job.peer, p.TransferFailed(req.transfer_id, req.room, result.error))
        else:
            log.info("room %d rid=%s: pushed %d bytes", req.room, req.rid, result.num_bytes)
        with self._lock:
            aborted, answered = self._matcher.finish(job)
        if aborted:
            self.server.send(job.peer, p.AbortAck(req.transfer_id, req.room))
        if job.on_done is not None and not answered:
            job.on_done(result)

    def _sweep(self, now: float) -> None:
        """Expire unmatched halves, and the waiting requests of decode peers silent for
        `peer_dead_after_s` or `DECODE_SILENT_S`, the longer (their handshake is kept: a stalled
        peer may come back). A decode worker pings from its compute thread, which one long step
        (a local prefill on CPU) may hold for seconds; nothing but memory waits on this."""
        silent_s = max(self.settings.peer_dead_after_s, DECODE_SILENT_S)
        with self._lock:
            expired = self._matcher.expire(now)
            for key, dec in self._decoders.items():
                if now - dec.last_seen > silent_s:
                    expired += self._matcher.drop_peer(key)
        self._fail_halves(expired, "expired before its other half arrived (or its peer is silent)")

    def _fail_halves(self, halves: list[Half], reason: str) -> None:
        """Answer each unmatched half: TransferFailed to its decode peer, an error to HTTP."""
        for half in halves:
            if half.req is not None and half.peer is not None:
                failed = p.TransferFailed(half.req.transfer_id, half.req.room, reason)
                self.server.send(half.peer, failed)
            if half.on_done is not None:
                half.on_done(PrefillResult(half.room, None, 0.0, 0, reason))
