"""The soak's real processes on loopback: a prefill peer, a decode worker with tiny pools, and the
SGLang Model Gateway (smg) in front of them when it is installed. Both servers also serve smg's
gRPC worker protocol (`--grpc-port`) unless `grpc=False`. Each can be killed and restarted on
the same ports. Metric names come from `decode_worker.io.metrics`, not from string
literals."""

from __future__ import annotations

from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from decode_worker.daemon.shared.procs import ServerProcess, free_port, http_json
from decode_worker.daemon.shared.router import SMG, Router, router_argv
from decode_worker.daemon.shared.router import has_router as router_installed
from decode_worker.errors import DecodeWorkerError
from decode_worker.io.metrics import Metrics

PAGE_SIZE = 16
DRAIN_GRACE_S = 4.0
# small pools force eviction and retraction (48 full pages: the full pool, not the SWA one, is
# what a burst runs short of, so decode growth retracts) and demotion to the host tier (on, at
# its default size: twice the device pool); short deadlines bound every failure
DECODE_SETTINGS = {
    "cache.num_full_pages": "48", "cache.num_swa_pages": "64", "cache.hierarchical_cache": "true",
    "scheduler.decode_reserve_tokens": "0", "scheduler.integrity_check_interval_s": "0.2",
    "scheduler.kv_timeout_s": "4", "scheduler.queue_timeout_s": "15",
    "transfer.peer_dead_after_s": "2", "transfer.abort_quiesce_s": "2",
    "server.drain_grace_s": str(DRAIN_GRACE_S),
}
_M = Metrics()
Scrape = dict[tuple[str, tuple[tuple[str, str], ...]], float]  # (name, labels) -> value


def metric_name(attr: str) -> str:
    """The exposed name of `Metrics().<attr>` (a renamed metric is followed automatically)."""
    return str(getattr(_M, attr).describe()[0].name)


def _sets(values: dict[str, str]) -> list[str]:
    return [x for k, v in values.items() for x in ("--set", f"{k}={v}")]


class Cluster:
    """Start with `start()`, stop everything with `stop()`; `restart_*` reuse the ports."""

    def __init__(self, model: Path, with_router: bool = True, grpc: bool = True,
                 spec: str = "none") -> None:
        """`spec`: the decode worker's speculative algorithm (NGRAM, SUFFIX, or none)."""
        self.model = model
        self.with_router = with_router and has_router()
        # every server binds its ports (gRPC too) and reports them; only the router's are
        # picked here (it cannot report them: Router retries on fresh ones)
        grpc_args = ["--grpc-port", "0"] if grpc else []
        self.prefill = ServerProcess("soak-prefill", [
            "prefill", "--port", "0", "--bootstrap-port", "0", *grpc_args,
            "--model", str(self.model), "--set", f"cache.page_size={PAGE_SIZE}"])
        self.decode = ServerProcess("soak-decode", [
            "serve", "--port", "0", *grpc_args, "--model", str(self.model),
            "--set", f"cache.page_size={PAGE_SIZE}", *_sets(DECODE_SETTINGS),
            "--speculative-algorithm", spec, "--speculative-num-draft-tokens", "4"])
        self.router: Router | None = None
        self.logs: list[str] = []

    @property
    def decode_port(self) -> int:
        return self.decode.port

    @property
    def boot_port(self) -> int:
        return self.prefill.ports["bootstrap"]

    @property
    def decode_url(self) -> str:
        return self.decode.url

    @property
    def prefill_url(self) -> str:
        return self.prefill.url

    @property
    def decode_grpc(self) -> str | None:
        """The decode worker's gRPC address (host:port), None without gRPC."""
        return self.decode.grpc_target

    @property
    def prefill_grpc(self) -> str | None:
        return self.prefill.grpc_target

    @property
    def router_url(self) -> str | None:
        return None if self.router is None else self.router.url

    def start(self) -> None:
        """Both servers on ports they bind (any free ones), then the router in front."""
        self.prefill.__enter__()
        self.decode.__enter__()
        self.prefill.wait_ready(180)
        self.decode.wait_ready(180)
        self.logs += [self.prefill.log.name, self.decode.log.name]
        if self.with_router:
            self._start_router()

    def _start_router(self) -> None:
        port = free_port()  # a taken one makes wait_workers retry on another
        self.router = Router(router_argv(
            SMG, [(self.prefill_url, self.boot_port)], [self.decode_url], port,
            health_interval_s=2, request_timeout_s=30), port, name="soak-router")
        self.router.__enter__()
        self.logs.append(self.router.log.name)
        try:
            self.router.wait_workers(2, 60)
        except DecodeWorkerError:
            self.router.stop()
            self.router = None  # soak on without it, and say so

    def restart_prefill(self) -> None:
        """Stop the prefill peer and start it again on the same ports."""
        self.prefill.stop(timeout_s=10)
        self.prefill = self.prefill.again()
        self.prefill.__enter__()
        self.prefill.wait_ready(180)
        self.logs.append(self.prefill.log.name)

    def restart_decode(self) -> None:
        """Start the (stopped) decode worker again on the same port."""
        self.decode = self.decode.again()
        self.decode.__enter__()
        self.decode.wait_ready(180)
        self.logs.append(self.decode.log.name)

    def stop(self) -> None:
        if self.router is not None:
            self.router.stop()
        self.decode.stop(timeout_s=DRAIN_GRACE_S + 10)
        self.prefill.stop(timeout_s=10)

    def decode_metrics(self) -> Scrape:
        """One /metrics scrape of the decode worker: (name, sorted labels) -> value."""
        with_text = http_json_text(f"{self.decode_url}/metrics")
        out = {}
        for fam in text_string_to_metric_families(with_text):
            for s in fam.samples:
                out[(s.name, tuple(sorted(s.labels.items())))] = float(s.value)
        return out


def has_router() -> bool:
    return router_installed(SMG)


def http_json_text(url: str, timeout_s: float = 10.0) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=timeout_s) as resp:
        return str(resp.read().decode())


def value(scrape: Scrape, attr: str,
          **labels: str) -> float:
    """Sum of the samples of metric `Metrics().<attr>` whose labels include `labels`; a
    counter's samples are named `<name>_total`."""
    name = metric_name(attr)
    names = {name, f"{name}_total"}
    return sum(v for (n, lab), v in scrape.items() if n in names
               and all(dict(lab).get(k) == want for k, want in labels.items()))


def held_pages(scrape: Scrape) -> int:
    """Pages neither free nor evictable (held by requests, or cached but locked), both device
    pools together, and host-tier pages locked (for a restore): 0 on an idle worker whose books
    balance. (Host copies of device-resident nodes are not evictable from the host tier yet
    not held either: only the locked ones count.)"""
    held = value(scrape, "pages_protected", pool="host")
    for pool in ("full", "swa"):
        held += (value(scrape, "pages_capacity", pool=pool) - value(scrape, "pages_available",
                 pool=pool) - value(scrape, "pages_evictable", pool=pool))
    return int(held)


def is_idle(scrape: Scrape) -> bool:
    return value(scrape, "queue_requests") == 0 and value(scrape, "draining") == 0


def health_ok(url: str) -> bool:
    try:
        http_json(f"{url}/health", timeout_s=3)
        return True
    except Exception:
        return False
