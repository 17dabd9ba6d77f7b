"""The reference prefill peer speaking SGLang 0.5.23's protocol (`prefill --protocol sglang`), as
a stock SGLang prefill server with attention TP 1 does (docs/PROTOCOLS.md):

- the bootstrap HTTP server on `transfer.bootstrap_host:bootstrap_port` (`/route`, `/health`),
  with this peer's one rank registered (page size = our pools', kv_cache_dtype "auto");
- the rank's ZMQ PULL socket (`transfer.prefill_rank_port`, 0 = any free port): decode agents
  register, send a TransferInfo per room and ABORTs; KV_STATUS / ABORT_ACK go back by PUSH;
- per room, once it has its prompt (HTTP /generate) and its TransferInfo(s), in either order:
  prefill into our pools, WRITE the KV pages [decode_prefix_len, L), the SWA window and the
  aux row, then KV_STATUS Success once every WRITE is DONE (Failed with a reason otherwise).

Threads: the channel thread runs `_on_info` / `_on_abort`; the compute thread owns torch, the
pools and the pipeline; `_lock` guards the room table they share.
"""

from __future__ import annotations

import logging
import time

from decode_worker.core.sampling import SamplingParams
from decode_worker.daemon.prefill.sglang_push import AuxStaging, Outcome, SglangPushPipeline
from decode_worker.daemon.prefill.sglang_state import ABORTED, Endpoint, Room, RoomTable
from decode_worker.daemon.prefill.sglang_state import Outcome as TableOutcome
from decode_worker.daemon.prefill.shell import PeerShell
from decode_worker.daemon.prefill.state import OnDone, PrefillResult
from decode_worker.device.runner import ModelRunner
from decode_worker.errors import DecodeWorkerError
from decode_worker.io.kv.protocol import RegionLayout
from decode_worker.io.kv.sglang.bootstrap_server import BootstrapHttpServer, BootstrapTable
from decode_worker.io.kv.sglang.frames import Abort, Status, TransferInfo
from decode_worker.io.kv.sglang.prefill_plan import Geometry
from decode_worker.io.kv.sglang.sender import RankChannel, advertised_ip
from decode_worker.settings import TransferSettings

log = logging.getLogger(__name__)


def geometry(runner: ModelRunner) -> Geometry:
    """Our pools as `prefill_plan` sees them: one row = one page of one layer, K then V; a
    model SGLang lays out with full KV in every layer (Gemma 3) is sent so, every layer a KV
    entry, as a stock SGLang prefill sends it."""
    pools, regions = runner.pools, {}
    for name in ("full", "swa"):
        t = pools.tensor(name)
        regions[name] = RegionLayout(name, t.data_ptr(), t.shape[0], t.shape[1],
                                     pools.page_bytes(name), t.device.index or 0,
                                     "VRAM" if t.is_cuda else "DRAM")  # fmt: skip
    num_layers = len(pools.spec.layer_types)
    all_layers = (tuple(pools.layer_slot(i) for i in range(num_layers))
                  if runner.model.cfg.sglang_ordinary else ())  # fmt: skip
    return Geometry(regions["full"], regions["swa"], pools.page_size, runner.window, all_layers)


def rank_registration(ip: str, port: int, page_size: int, http_port: int) -> dict[str, object]:
    """The PUT /route body of our one rank: SGLang's keys in its order, attention TP/CP/DP and
    PP 1 (so rank 0 of each)."""
    sizes = ("attn_tp", "attn_cp", "attn_dp", "pp", "system_dp")
    body: dict[str, object] = {}
    for size in sizes:
        body |= {f"{size}_size": 1, f"{size}_rank": 0}
    return {**body, "rank_ip": ip, "rank_port": port, "page_size": page_size,
            "kv_cache_dtype": "auto", "kv_layout": None, "dsv41_spec_layout": None,
            "load_balance_method": "follow_bootstrap_room",
            "enable_dsa_cache_layer_split": False, "enable_kv_cache_sharding": False,
            "prefill_http_port": http_port, "decode_allocation_policy": "early"}


class SglangPrefillPeer(PeerShell[Room]):
    """Serve SGLang's prefill protocol until `close()`; `add_prompt` as `PrefillPeer`'s.

    Raises TransferError if a port cannot be bound, ConfigError if NIXL cannot start.
    """

    JOIN_TIMEOUT_S = 15.0  # the 10 s drain, plus up to 5 s a failed post waits (`_post_all`)
    server: BootstrapHttpServer
    _push: SglangPushPipeline

    def __init__(
        self, runner: ModelRunner, settings: TransferSettings, http_port: int,
        num_aux_rows: int = 256, match_timeout_s: float = 60.0,
    ) -> None:  # fmt: skip
        super().__init__(runner, settings)
        self.staging = AuxStaging(num_aux_rows)
        self.agent.register([*runner.pools.memory_regions(), self.staging.memory_region()])
        self._rooms = RoomTable(match_timeout_s)
        self.channel = RankChannel(settings.bootstrap_host, settings.prefill_rank_port,
                                   self.agent, self._on_info, self._on_abort)
        self._push = SglangPushPipeline(runner, geometry(runner), self.staging, self.agent,
                                        self.channel.registration, self._finish, match_timeout_s)
        self.table = BootstrapTable()
        self.table.put_route(rank_registration(advertised_ip(settings.bootstrap_host),
                                               self.channel.port, runner.pools.page_size,
                                               http_port))  # fmt: skip
        self.server = BootstrapHttpServer(settings.bootstrap_host, settings.bootstrap_port,
                                          self.table)
        self._serve()

    # -- the two halves (`add_prompt`: PeerShell) --------------------------------------------

    def _add_prompt(self, room: int, token_ids: list[int], on_done: OnDone | None,
                    sampling: SamplingParams | None) -> None:
        with self._lock:
            out = self._rooms.add_prompt(room, token_ids, on_done, sampling, time.monotonic())
        self._apply(out)

    def _on_info(self, info: TransferInfo) -> None:
        with self._lock:
            out = self._rooms.add_info(info, time.monotonic())
        self._apply(out)

    def _on_abort(self, abort: Abort) -> None:
        with self._lock:
            out = self._rooms.abort(abort, time.monotonic())
        log.info("room %d: ABORT from decode %s:%s", abort.room, abort.ip, abort.port)
        self._apply(out)

    def _apply(self, out: TableOutcome) -> None:
        for room, reason in out.fail:
            _answer(room, PrefillResult(room.room, None, 0.0, 0, reason))
        self._ack(out.acks)
        if out.start is not None:
            self._jobs.put(out.start)

    def _ack(self, acks: list[tuple[Endpoint, int, int]]) -> None:
        for target, room, generation in acks:
            self.channel.send_abort_ack(target, room, generation)

    # -- compute thread ----------------------------------------------------------------------

    def _start(self, room: Room) -> None:
        with self._lock:
            aborted = self._rooms.is_aborted(room)
        if aborted:  # aborted while queued: nothing was written, ack without a status
            with self._lock:
                acks = self._rooms.finish(room)
            self._ack(acks)
            _answer(room, PrefillResult(room.room, None, 0.0, 0, ABORTED))
            return
        try:
            self._push.post(room)
        except DecodeWorkerError as exc:
            self._finish(room, PrefillResult(room.room, None, 0.0, 0, str(exc)), "failed")
        except Exception as exc:  # loop boundary: a model bug fails this room, not the peer
            log.exception("room %d: prefill failed", room.room)
            error = f"prefill failed: {type(exc).__name__}: {exc}"
            self._finish(room, PrefillResult(room.room, None, 0.0, 0, error), "failed")

    def _finish(self, room: Room, result: PrefillResult, outcome: Outcome) -> None:
        """Tell the decode side(s) and the HTTP side how the room ended (compute thread)."""
        with self._lock:
            acks = self._rooms.finish(room)
        if outcome != "stuck":  # a stuck WRITE may still land: no ABORT_ACK (SGLang's poison)
            self._ack(acks)  # SGLang: the drained ABORT_ACK goes before the status
        if outcome == "landed" and not room.aborted:
            self.channel.send_status(room.targets(), room.room, Status.SUCCESS)
            log.info("room %d: pushed %d bytes (sglang)", room.room, result.num_bytes)
            _answer(room, result)
            return
        reason = (ABORTED if room.aborted else result.error
                  or f"NIXL transfer encountered ERR room={room.room}")  # fmt: skip
        if outcome != "stuck":  # a WRITE may still land: leave it to the decode's timeout
            self.channel.send_status(room.targets(), room.room, Status.FAILED, reason)
        log.warning("room %d: %s (%s)", room.room, reason, outcome)
        _answer(room, PrefillResult(room.room, None, 0.0, 0, reason))

    def _sweep(self, now: float) -> None:
        """Fail the rooms that waited too long for their other half, on both sides."""
        with self._lock:
            expired = self._rooms.expire(now)
        for room in expired:
            half = "prefill request" if room.prompt is None else "TransferInfo"
            reason = f"no {half} for room {room.room} within {self._rooms.timeout_s:.0f} s"
            self.channel.send_status(room.targets(), room.room, Status.FAILED, reason)
            _answer(room, PrefillResult(room.room, None, 0.0, 0, reason))

    def _close_links(self) -> None:
        self.channel.close()


def _answer(room: Room, result: PrefillResult) -> None:
    if room.on_done is not None:
        room.on_done(result)
