"""Every Prometheus metric of the worker, on its own registry (names: docs/CONTRACTS.md).

The daemon and the API layer call `Metrics` methods; nothing else creates metrics. All methods
are thread-safe (prometheus_client locks internally), so the compute thread may call them too.
Label values are closed sets where the contract says so: an unknown abort/failure reason is
recorded as `internal` (and logged) rather than growing the label space.

Who observes what (so nothing is counted twice):
- the API layer (`io/api`): `http_requests_total`, `time_to_first_token_seconds`,
  `inter_token_latency_seconds`, `request_e2e_seconds` (measured at the HTTP boundary from
  `GenerateInput.received_at`), unless the app is built with `observe_latency=False`;
- the decode engine's books, once per step: everything else, from the plain counts that core
  (admission, decode pages), the request table and the KV receiver keep (`set_totals` moves a
  counter up to the total counted so far), and the pool and queue gauges.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Mapping

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

log = logging.getLogger(__name__)
_LABEL_WORD = re.compile(r"^[a-z][a-z0-9_]{0,39}$")

PREFIX = "decode_worker_"
POOLS = ("full", "swa")
QUEUES = ("prealloc", "transfer", "running")
PEER_PROTOCOLS = ("native", "sglang")
REQUEST_STATUSES = ("finished", "aborted", "failed")
ABORT_REASONS = (
    "client_abort", "kv_timeout", "queue_timeout", "too_large", "swa_reclaim_insufficient",
    "transfer_failed", "peer_dead", "drain", "bad_request", "queue_full", "internal",
    "restore_failed",
)
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10)
SPEC_ACCEPT_BUCKETS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 33)  # tokens per verify
RESTORE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                   1.0)
KV_EVENT_LAG_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                        0.25, 1.0)
KV_EVENT_TRANSPORTS = ("zmq", "grpc")  # the ZMQ publisher, SubscribeKvEvents streams
DESCRIPTOR_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096, 16384)
DECODE_ABORT_OUTCOMES = ("answered", "early", "late")  # prefill peer: decode-side room ends
TRANSFER_FAILURE_REASONS = ("transfer_failed", "peer_dead", "kv_timeout", "bad_request",
                            "kv_checksum")


class Metrics:
    """The worker's metrics. One instance per process (or per test: each has its own registry)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        # `*_created` series only add noise to dashboards; this switch is process-wide, and
        # every metric of the process lives here.
        disable_created_metrics()  # type: ignore[no-untyped-call]
        self.registry = registry if registry is not None else CollectorRegistry()
        self._build_counters()
        self._build_gauges()
        self._build_histograms()
        self._prefill_labels()

    def _counter(self, name: str, doc: str, labels: Iterable[str] = ()) -> Counter:
        # prometheus_client appends `_total` to a counter's name on exposition.
        return Counter(PREFIX + name, doc, list(labels), registry=self.registry)

    def _gauge(self, name: str, doc: str, labels: Iterable[str] = ()) -> Gauge:
        return Gauge(PREFIX + name, doc, list(labels), registry=self.registry)

    def _hist(self, name: str, doc: str, buckets: tuple[float, ...],
              labels: Iterable[str] = ()) -> Histogram:
        return Histogram(PREFIX + name, doc, list(labels), buckets=buckets,
                         registry=self.registry)

    def _build_counters(self) -> None:
        c = self._counter
        self.prefix_query_tokens = c("prefix_cache_query_tokens", "Tokens looked up in the tree")
        self.prefix_hit_tokens = c("prefix_cache_hit_tokens", "Tokens found in the tree (full)")
        self.transfer_received_tokens = c("transfer_received_tokens", "Tokens whose KV arrived")
        self.admissions = c("admissions", "Requests admitted to the decode batch")
        self.aborts = c("aborts", "Aborted requests by reason", ["reason"])
        self.retractions = c("retractions", "Requests retracted to free pages")
        self.requests = c("requests", "Requests ended, by status", ["status"])
        self.generated_tokens = c("generated_tokens", "Output tokens generated")
        self.transfer_bytes = c("transfer_bytes", "KV bytes received by transfer")
        self.transfer_failures = c("transfer_failures", "Failed KV transfers by reason", ["reason"])
        self.http_requests = c("http_requests", "HTTP requests by endpoint and status",
                               ["endpoint", "code"])
        self.grpc_requests = c("grpc_requests", "gRPC calls (smg's SglangScheduler service) by "
                               "method and status code", ["method", "code"])
        self.evicted_pages = c("kv_evicted_pages", "Cached pages evicted from the tree", ["pool"])
        self.swa_released_pages = c("kv_swa_released_pages",
                                    "Request SWA pages freed as the window slid past them")
        self.admission_passes = c("admission_passes", "Passes of the prealloc queue")
        self.transfer_quiesce_expired = c(
            "transfer_quiesce_expired", "Failed or aborted transfers whose pages were released "
            "by transfer.abort_quiesce_s, not by the peer's acknowledgement")
        self.transfer_bad_frames = c("transfer_bad_frames", "Undecodable messages from peers")
        self.transfer_pushes = c("transfer_pushes", "KV transfers pushed (prefill peer)")
        self.transfer_pushed_bytes = c("transfer_pushed_bytes", "KV bytes pushed (prefill peer)")
        self.transfer_kv_checksum_failures = c(
            "transfer_kv_checksum_failures", "Transfers whose KV checksum did not match "
            "(transfer.kv_checksum; the request fails with kv_checksum)")
        self.transfer_decode_aborts = c(
            "transfer_decode_aborts", "Prefill peer: requests a decode worker ended before their "
            "KV went, by outcome (answered, early: before the prompt came, late: ignored)",
            ["outcome"])
        self.kv_events_published_events = c(
            "kv_events_published_events", "KV events sent on the ZMQ publisher")
        self.kv_events_published_batches = c(
            "kv_events_published_batches", "KV event batches sent on the ZMQ publisher")
        self.kv_events_dropped_batches = c(
            "kv_events_dropped_batches", "KV event batches a subscriber lost: its high-water "
            "mark was reached, or the sender fell behind the event log")
        self.host_hit_tokens = c("prefix_cache_host_hit_tokens",
                                 "Of the hit tokens, those restored from the host tier")
        self.host_restored_tokens = c("kv_host_restored_tokens",
                                      "Tokens of full KV restored host -> device")
        self.host_restored_bytes = c("kv_host_restored_bytes",
                                     "Bytes of full KV restored host -> device")
        self.host_written_bytes = c("kv_host_written_bytes",
                                    "Bytes of full KV written device -> host (write policy)")
        self.host_evicted_pages = c("kv_host_evicted_pages", "Host-tier pages evicted (LRU)")
        self.host_restore_failures = c(
            "kv_host_restore_failures", "Host -> device restores that failed (each ended its "
            "request: restore_failed)")
        self.host_write_failures = c(
            "kv_host_write_failures", "Host-tier writes skipped because the host pool stayed "
            "full (the node stays device-only; nothing fails)")
        self.host_write_waits = c(
            "kv_host_write_waits", "Transfers that waited for a host-tier write still reading "
            "their device pages before they were posted (CUDA; each a host-thread wait)")
        self.spec_proposed_tokens = c("spec_proposed_tokens", "Speculative decoding: draft "
                                      "tokens proposed (and verified)")
        self.spec_accepted_tokens = c("spec_accepted_tokens", "Speculative decoding: draft "
                                      "tokens kept (the bonus token not counted)")
        self.spec_verify_steps = c("spec_verify_steps", "Speculative decoding: verify steps "
                                   "(one forward over every running request's drafts)")
        self._totals: dict[tuple[str, str], float] = {}  # what set_totals has reached

    def _build_gauges(self) -> None:
        g = self._gauge
        self.pages_available = g("kv_pages_available", "Free KV pages", ["pool"])
        self.pages_used = g("kv_pages_used", "KV pages held by requests or the tree", ["pool"])
        self.pages_evictable = g("kv_pages_evictable", "Tree pages that can be evicted", ["pool"])
        self.pages_protected = g("kv_pages_protected", "Tree pages locked by requests", ["pool"])
        # not `kv_pages_total`: a gauge must not end in `_total` (promtool check metrics)
        self.pages_capacity = g("kv_pages_capacity", "KV pages in the pool (page 0 excluded)",
                             ["pool"])
        self.queue_requests = g("queue_requests", "Requests per queue", ["queue"])
        self.draining = g("draining", "1 while the worker drains (SIGTERM), else 0")
        self.transfer_peers = g("transfer_peers", "Prefill peers known, by the protocol they "
                                "speak", ["protocol"])

    def _build_histograms(self) -> None:
        h = self._hist
        self.transfer_duration = h("transfer_duration_seconds", "KV transfer time",
                                   TRANSFER_BUCKETS)
        self.transfer_descriptors = h("transfer_descriptors", "NIXL descriptors per transfer",
                                      DESCRIPTOR_BUCKETS)
        self.ttft = h("time_to_first_token_seconds", "Receipt to first output token", TTFT_BUCKETS)
        self.itl = h("inter_token_latency_seconds", "Time between output tokens", ITL_BUCKETS)
        self.e2e = h("request_e2e_seconds", "Receipt to last output token", E2E_BUCKETS)
        self.host_restore_duration = h("kv_host_restore_duration_seconds",
                                       "Host -> device restore time per request", RESTORE_BUCKETS)
        self.spec_accept_length = h(
            "spec_accept_length", "Speculative decoding: tokens one verify step committed for "
            "one request (kept drafts + the bonus token)", SPEC_ACCEPT_BUCKETS)
        self.spec_verify_duration = h(
            "spec_verify_duration_seconds", "Speculative decoding: one verify step (drafts, "
            "forward, acceptance, commit)", ITL_BUCKETS)
        self.kv_event_lag = h(
            "kv_event_lag_seconds", "KV events: from a batch's append to the event log (the end "
            "of the decode step that changed the tree) to its send, per transport (zmq: the "
            "publisher socket; grpc: each SubscribeKvEvents stream)", KV_EVENT_LAG_BUCKETS,
            ["transport"])

    def _prefill_labels(self) -> None:
        """Create the known children so that every series is exported from the start (at 0)."""
        for pool in POOLS:
            for gauge in self._pool_gauges():
                gauge.labels(pool=pool)
        for queue in QUEUES:
            self.queue_requests.labels(queue=queue)
        for reason in ABORT_REASONS:
            self.aborts.labels(reason=reason)
        for reason in TRANSFER_FAILURE_REASONS:  # so rate() sees the very first failure
            self.transfer_failures.labels(reason=reason)
        for status in REQUEST_STATUSES:
            self.requests.labels(status=status)
        for pool in POOLS:
            self.evicted_pages.labels(pool=pool)
        for protocol in PEER_PROTOCOLS:
            self.transfer_peers.labels(protocol=protocol)
        for outcome in DECODE_ABORT_OUTCOMES:
            self.transfer_decode_aborts.labels(outcome=outcome)
        for transport in KV_EVENT_TRANSPORTS:
            self.kv_event_lag.labels(transport=transport)

    def _pool_gauges(self) -> tuple[Gauge, ...]:
        return (self.pages_available, self.pages_used, self.pages_evictable,
                self.pages_protected, self.pages_capacity)

    # -- what the daemon calls -------------------------------------------------------------

    def update_pool(
        self, pool: str, *, available: int, used: int, evictable: int, protected: int, total: int
    ) -> None:
        """Set one pool's page gauges (pool is "full", "swa", "host" or "landing")."""
        values = (available, used, evictable, protected, total)
        for gauge, value in zip(self._pool_gauges(), values, strict=True):
            gauge.labels(pool=pool).set(value)

    def observe_spec(self, accept_lengths: Iterable[int], verify_s: Iterable[float]) -> None:
        for n in accept_lengths:
            self.spec_accept_length.observe(n)
        for d in verify_s:
            self.spec_verify_duration.observe(d)

    def observe_host_restores(self, durations_s: Iterable[float]) -> None:
        for d in durations_s:
            self.host_restore_duration.observe(d)

    def update_queues(self, *, prealloc: int, transfer: int, running: int) -> None:
        for queue, value in zip(QUEUES, (prealloc, transfer, running), strict=True):
            self.queue_requests.labels(queue=queue).set(value)

    def observe_prefix_match(self, query_tokens: int, hit_tokens: int) -> None:
        """One tree lookup: `query_tokens` asked, `hit_tokens` reused (full pool)."""
        self.prefix_query_tokens.inc(query_tokens)
        self.prefix_hit_tokens.inc(hit_tokens)

    def inc_admission(self, n: int = 1) -> None:
        self.admissions.inc(n)

    def inc_abort(self, reason: str) -> None:
        """One aborted request; also counts requests_total{status="aborted"}."""
        self.aborts.labels(reason=_known(reason, ABORT_REASONS, "abort")).inc()
        self.requests.labels(status="aborted").inc()

    def inc_retraction(self, n: int = 1) -> None:
        self.retractions.inc(n)

    def inc_request(self, status: str) -> None:
        """A request ended as "finished" or "failed" (aborts go through `inc_abort`)."""
        self.requests.labels(status=_known(status, REQUEST_STATUSES, "status", "failed")).inc()

    def inc_generated_tokens(self, n: int) -> None:
        self.generated_tokens.inc(n)

    def observe_transfer(self, num_bytes: int, duration_s: float, num_descriptors: int,
                         num_tokens: int) -> None:
        """One completed KV transfer into this worker."""
        self.transfer_bytes.inc(num_bytes)
        self.transfer_duration.observe(duration_s)
        self.transfer_descriptors.observe(num_descriptors)
        self.transfer_received_tokens.inc(num_tokens)

    def observe_push(self, num_bytes: int) -> None:
        """One KV transfer the prefill peer completed to a decode worker."""
        self.transfer_pushes.inc()
        self.transfer_pushed_bytes.inc(num_bytes)

    def inc_decode_abort(self, outcome: str) -> None:
        """Prefill peer: one decode-side end of a room ("answered", "early" or "late")."""
        label = _known(outcome, DECODE_ABORT_OUTCOMES, "decode abort outcome", "late")
        self.transfer_decode_aborts.labels(outcome=label).inc()

    def inc_transfer_failure(self, reason: str) -> None:
        """`reason` is a short snake_case word (e.g. an abort reason); anything else -> internal."""
        label = reason if _LABEL_WORD.match(reason) else _known(reason, (), "transfer failure")
        self.transfer_failures.labels(reason=label).inc()

    def set_peers(self, by_protocol: Mapping[str, int]) -> None:
        """Prefill peers known per protocol ("native", "sglang")."""
        for protocol in PEER_PROTOCOLS:
            self.transfer_peers.labels(protocol=protocol).set(by_protocol.get(protocol, 0))

    def set_totals(self, totals: Mapping[str, int | Mapping[str, int]]) -> None:
        """Move counters up to running totals: `{"admissions": 12, "aborts": {"drain": 1}}`
        (counter attribute -> total, or label value -> total for a counter with one label).
        A total below what was reached before (a restarted count) moves nothing."""
        for name, value in totals.items():
            counter: Counter = getattr(self, name)
            per_label = value if isinstance(value, Mapping) else {"": value}
            for label, total in per_label.items():
                done = self._totals.get((name, label), 0.0)
                if total > done:
                    child = counter.labels(self._label(name, label)) if label else counter
                    child.inc(total - done)
                    self._totals[(name, label)] = float(total)

    def _label(self, name: str, value: str) -> str:
        if name == "aborts":
            return _known(value, ABORT_REASONS, "abort")
        if name == "requests":
            return _known(value, REQUEST_STATUSES, "status", "failed")
        if name == "transfer_failures" and not _LABEL_WORD.match(value):
            return _known(value, (), "transfer failure")
        return value

    def observe_transfer_samples(self, samples: Iterable[tuple[float, int]]) -> None:
        """Duration and NIXL descriptors of completed transfers (bytes and tokens are totals)."""
        for duration_s, num_descriptors in samples:
            self.transfer_duration.observe(duration_s)
            self.transfer_descriptors.observe(num_descriptors)

    def inc_kv_events(self, *, events: int = 0, batches: int = 0, dropped: int = 0) -> None:
        """KV events published / batches published / batches dropped (the ZMQ sender thread)."""
        if events:
            self.kv_events_published_events.inc(events)
        if batches:
            self.kv_events_published_batches.inc(batches)
        if dropped:
            self.kv_events_dropped_batches.inc(dropped)

    def observe_kv_event_lag(self, transport: str, lag_s: float) -> None:
        """One KV-event batch sent on `transport` ("zmq" / "grpc") `lag_s` after its append
        (the sender thread, or the event loop)."""
        self.kv_event_lag.labels(transport=transport).observe(max(0.0, lag_s))

    def set_draining(self, draining: bool) -> None:
        self.draining.set(1 if draining else 0)

    # -- what the API layer calls ----------------------------------------------------------

    def observe_ttft(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def observe_itl(self, seconds: float) -> None:
        self.itl.observe(seconds)

    def observe_e2e(self, seconds: float) -> None:
        self.e2e.observe(seconds)

    def inc_http(self, endpoint: str, code: int) -> None:
        """`endpoint` must be a route name (a closed set), never a raw client path."""
        self.http_requests.labels(endpoint=endpoint, code=str(code)).inc()

    def inc_grpc(self, method: str, code: str) -> None:
        """`method`: an RPC of the service; `code`: a gRPC status code name (OK, CANCELLED...)."""
        self.grpc_requests.labels(method=method, code=code).inc()

    def exposition(self) -> tuple[bytes, str]:
        """The text exposition and its content type, for GET /metrics."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


def _known(value: str, allowed: tuple[str, ...], what: str, fallback: str = "internal") -> str:
    if value in allowed:
        return value
    log.warning("metrics: unknown %s label %r recorded as %r", what, value, fallback)
    return fallback
