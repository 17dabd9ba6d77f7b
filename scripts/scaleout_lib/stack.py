"""The scale-out stack on loopback: one prefill peer, N decode workers, and a router per run.

`Stack(model, num_decode, pool_pages)` starts the servers (`with`); `stack.routed(policy, n)`
starts a router (smg by default) in PD mode in front of the prefill peer and the first `n`
decode workers with that decode policy, waits until it lists them, and stops it on exit.
`flush()` empties every decode worker's prefix cache (between runs, so each policy starts
cold); `served()` reads how many requests each decode worker has ended (its
`decode_worker_requests_total`), so a run's share per worker is a difference of two reads.
"""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from decode_worker.daemon.shared.procs import PdServers, free_port, http_json, scrape_metric
from decode_worker.daemon.shared.router import SMG, Router, router_argv

PAGE_SIZE = 16


class Stack(PdServers):
    """Prefill peer + `num_decode` decode workers; `pool_pages` (if set) sizes both KV pools
    of each decode worker, to force eviction."""

    def __init__(self, model: Path, num_decode: int, pool_pages: int | None = None,
                 router_kind: str = SMG, grpc: bool = False) -> None:
        pools = [] if pool_pages is None else [
            "--set", f"cache.num_full_pages={pool_pages}",
            "--set", f"cache.num_swa_pages={pool_pages}"]
        super().__init__(["--model", str(model), "--set", f"cache.page_size={PAGE_SIZE}"],
                         num_decode, decode_args=pools, ready_timeout_s=180, grpc=grpc)
        self.router_kind = router_kind
        if grpc:  # KV events (each worker its own ZMQ port): smg streams them over gRPC
            for d in self.decodes:
                d.args += ["--kv-events-config",
                           '{"publisher": "zmq", "endpoint": "tcp://*:0"}']  # any free port

    def model_name(self) -> str:
        return str(http_json(f"{self.decodes[0].url}/v1/models")["data"][0]["id"])

    @contextmanager
    def routed(self, policy: str, num_decode: int | None = None,
               extra: Sequence[str] = (), grpc: bool = False) -> Iterator[Router]:
        """A router in front of the prefill peer and the first `num_decode` decode workers
        (all by default), `policy` on the decode side (round robin on the one prefill);
        `extra`: more router flags; `grpc`: smg's gRPC mode (`grpc://` URLs; the servers
        were started with `grpc=True`). In gRPC mode smg subscribes to KV events only under
        a model-level cache_aware policy, so that is the policy of both sides there."""
        decodes = self.decodes[: num_decode or len(self.decodes)]
        port = free_port()
        prefill, urls = self.prefill.url, [d.url for d in decodes]
        if grpc:
            prefill = f"grpc://{self.prefill.grpc_target}"
            urls = [f"grpc://{d.grpc_target}" for d in decodes]
        argv = router_argv(self.router_kind, [(prefill, self.boot_port)], urls, port,
                           policy=policy if grpc else "round_robin",
                           decode_policy=policy, request_timeout_s=300, extra=extra)
        router = Router(argv, port, name=f"router-{policy}")
        with router:
            router.wait_workers(1 + len(decodes), 60)
            yield router

    def flush(self, timeout_s: float = 60.0) -> None:
        """Every decode worker's cache emptied (each waits until it is idle)."""
        for d in self.decodes:
            req = urllib.request.Request(f"{d.url}/flush_cache?timeout={timeout_s:g}",
                                         data=b"", method="POST")
            with urllib.request.urlopen(req, timeout=timeout_s + 10) as resp:
                resp.read()  # 200 text; a refusal (400) raises HTTPError

    def served(self, status: str = "") -> list[int]:
        """Requests each decode worker has ended so far (with `status`, e.g. "finished": only
        those; empty: any status)."""
        labels = f'status="{status}"' if status else ""
        return [int(scrape_metric(d.url, "decode_worker_requests_total", labels))
                for d in self.decodes]
