"""The ZMQ KV-event publisher: SGLang 0.5.23's PUB stream and ROUTER replay, fed by the hub.

`ZmqKvEventPublisher.bind(cfg)` opens the sockets at start-up (a bad or busy endpoint is a
`ConfigError` naming the key; a tcp port 0 or `*` binds any free port: `bound_ports`,
`bound_config`); `start(hub)` runs the sender thread, which reads the worker's one
event log (`KvEventHub`) with its own cursor, encodes each batch (`wire`) and sends
`[topic, seq8, payload]` without ever blocking: the compute thread only appends to the log.
Each send reports to `gate` (`AnswerGate`): a step's answers leave only once the batches
appended up to that step are sent, so a client's next request never meets a router whose view
of this worker lags its answer. `decode_worker_kv_event_lag_seconds{transport="zmq"}` is the
time from a batch's append (the end of its step) to its send.

Drops are counted, never waited out: the stream socket is an XPUB with `XPUB_NODROP`, so when a
connected subscriber's high-water mark (`hwm`) is reached the send fails at once and the batch
counts as dropped (subscribers see the gap in `seq` and can replay it); a sender that falls
more than `buffer_steps` batches behind the log skips them and counts them too. With no
subscriber connected a batch goes nowhere, as on SGLang's PUB socket. `max_queue_size` is
accepted for compatibility; the log's ring (`buffer_steps`) is the queue.

Replay (optional ROUTER at `replay_endpoint`): a request `[identity, b"", start_seq(8 bytes
big-endian)]` gets every buffered batch with seq >= start as `[identity, b"", topic, seq8,
payload]`, then the end marker `[identity, b"", b"", END_SEQ, b""]`, as 0.5.23 answers. A
malformed request gets the end marker alone (0.5.23 answers nothing to a wrong frame count,
leaving the client waiting).
"""

from __future__ import annotations

import logging
import threading
import time

import zmq

from decode_worker.errors import ConfigError
from decode_worker.io.kv_events.config import offset_endpoint_port, tcp_host_port, with_port
from decode_worker.io.kv_events.gate import AnswerGate
from decode_worker.io.kv_events.hub import KvEventBatch, KvEventHub, KvSubscription
from decode_worker.io.kv_events.wire import END_SEQ, encode_batch, seq_bytes
from decode_worker.io.metrics import Metrics
from decode_worker.settings.kv_events import KvEventsConfig

log = logging.getLogger(__name__)
_WAIT_S = 0.01  # the sender's wait for a batch; replay requests are served between waits


class ZmqKvEventPublisher:
    """See module docstring. `bind`, `start(hub)`, `close()`."""

    def __init__(self, cfg: KvEventsConfig, metrics: Metrics | None, dp_rank: int = 0) -> None:
        self.cfg, self.metrics, self.dp_rank = cfg, metrics, dp_rank
        self.topic = cfg.topic.encode()
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self.pub = self.ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.XPUB_NODROP, 1)
        self.pub.setsockopt(zmq.SNDHWM, cfg.hwm)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.replay: zmq.Socket[bytes] | None = None
        self.endpoint = self.replay_endpoint = ""
        self.num_published_batches = self.num_published_events = self.num_dropped_batches = 0
        self.num_bad_replay_requests = 0
        self.num_subscriptions = 0  # subscribe notices seen (XPUB)
        self._hub: KvEventHub | None = None
        self.gate: AnswerGate | None = None  # set by `start`
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def bind(cls, cfg: KvEventsConfig, metrics: Metrics | None = None,
             dp_rank: int = 0) -> ZmqKvEventPublisher:
        """Open the sockets (bind or connect as SGLang decides). Raises `ConfigError`."""
        self = cls(cfg, metrics, dp_rank)
        try:
            self._open()
        except BaseException:
            self.close()
            raise
        return self

    def _open(self) -> None:
        cfg = self.cfg
        endpoint = offset_endpoint_port(cfg.endpoint, self.dp_rank) or ""
        try:
            if cfg.should_bind():
                self.pub.bind(endpoint)
                self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
            else:
                self.pub.connect(endpoint)
                self.endpoint = endpoint
        except (zmq.ZMQError, ValueError) as exc:
            raise ConfigError(f"kv_events.config: key 'endpoint'={endpoint!r}: cannot "
                              f"{'bind' if cfg.should_bind() else 'connect'}: {exc}") from None
        replay = offset_endpoint_port(cfg.replay_endpoint, self.dp_rank)
        if replay:
            self.replay = self.ctx.socket(zmq.ROUTER)
            self.replay.setsockopt(zmq.LINGER, 0)
            try:
                self.replay.bind(replay)
            except (zmq.ZMQError, ValueError) as exc:
                raise ConfigError(f"kv_events.config: key 'replay_endpoint'={replay!r}: cannot "
                                  f"bind: {exc}") from None
            self.replay_endpoint = self.replay.getsockopt_string(zmq.LAST_ENDPOINT)

    def bound_ports(self) -> dict[str, int]:
        """The tcp ports this publisher bound ("kv_events", "kv_events_replay"), for
        `--ports-file`: what a port-0 (or `*`) endpoint got. Empty for a connected or non-tcp
        one."""
        ports: dict[str, int] = {}
        for name, endpoint in (("kv_events", self.endpoint if self.cfg.should_bind() else ""),
                               ("kv_events_replay", self.replay_endpoint)):
            bound = tcp_host_port(endpoint)
            if bound is not None:
                ports[name] = bound[1]
        return ports

    def bound_config(self) -> KvEventsConfig:
        """The configuration with each port-0 (or `*`) tcp endpoint given the port it bound
        (what /server_info reports); the configured host is kept (`*` stays `*`)."""
        ports, cfg = self.bound_ports(), self.cfg
        update: dict[str, str] = {}
        for key, name in (("endpoint", "kv_events"), ("replay_endpoint", "kv_events_replay")):
            configured = getattr(cfg, key)
            if configured and configured.endswith((":0", ":*")) and name in ports:
                update[key] = with_port(configured, ports[name])
        return cfg.model_copy(update=update)

    def start(self, hub: KvEventHub) -> None:
        """Start the sender thread on `hub`'s log, from the batch the log appends next, and
        its `gate` (for the engine's outbox)."""
        self._hub = hub
        self.gate = AnswerGate(hub)
        sub = hub.subscribe(hub.next_seq, snapshots=False)
        self._thread = threading.Thread(target=self._run, args=(sub,), daemon=True,
                                        name="kv-events-zmq")
        self._thread.start()

    def _run(self, sub: KvSubscription) -> None:
        skipped = 0
        try:
            while not self._stop.is_set():
                self._service()
                item = sub.get(_WAIT_S)
                if sub.num_skipped_batches != skipped:
                    self._count(dropped=sub.num_skipped_batches - skipped)
                    skipped = sub.num_skipped_batches
                if isinstance(item, KvEventBatch):
                    self._send(item)
                    if self.gate is not None:
                        self.gate.sent(item.seq + 1)
        except Exception:  # the thread's boundary: never take the worker down, say so
            log.exception("KV event publisher stopped")
        finally:
            sub.close()
            if self.gate is not None:  # answers no longer wait for this thread
                self.gate.open()

    def _send(self, batch: KvEventBatch) -> None:
        payload = encode_batch(batch)
        try:
            self.pub.send_multipart([self.topic, seq_bytes(batch.seq), payload], zmq.NOBLOCK)
        except zmq.Again:  # a subscriber is at its high-water mark: drop, count, go on
            self._count(dropped=1)
            return
        self._count(events=len(batch.events), batches=1)
        if self.metrics is not None and batch.at:
            self.metrics.observe_kv_event_lag("zmq", time.monotonic() - batch.at)

    def _count(self, *, events: int = 0, batches: int = 0, dropped: int = 0) -> None:
        self.num_published_events += events
        self.num_published_batches += batches
        self.num_dropped_batches += dropped
        if self.metrics is not None:
            self.metrics.inc_kv_events(events=events, batches=batches, dropped=dropped)

    def _service(self) -> None:
        """Drain subscription notices (XPUB) and answer waiting replay requests."""
        while self.pub.poll(0):
            notice = self.pub.recv_multipart()
            if notice and notice[0][:1] == b"\x01":
                self.num_subscriptions += 1
        while self.replay is not None and self.replay.poll(0):
            self._answer_replay(self.replay.recv_multipart())

    def _answer_replay(self, frames: list[bytes]) -> None:
        assert self.replay is not None
        if len(frames) < 1:
            return
        ident = frames[0]
        if len(frames) == 3 and len(frames[2]) == 8:
            start = int.from_bytes(frames[2], "big")
            for batch in self._hub.replay(start) if self._hub is not None else []:
                self.replay.send_multipart([ident, b"", self.topic, seq_bytes(batch.seq),
                                            encode_batch(batch)], zmq.NOBLOCK)
        else:
            self.num_bad_replay_requests += 1
            log.warning("malformed KV-event replay request (%d frames): answered with the "
                        "end marker", len(frames))
        self.replay.send_multipart([ident, b"", b"", END_SEQ, b""], zmq.NOBLOCK)

    def close(self, timeout_s: float = 2.0) -> None:
        """Stop the sender thread (bounded) and close the sockets."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        self.pub.close(0)
        if self.replay is not None:
            self.replay.close(0)
