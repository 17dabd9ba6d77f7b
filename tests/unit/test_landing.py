"""The landing area's books as the request table drives them (an SGLang prefill of a model it
lays out with full KV in every layer): room is bounded and taken in arrival order (a request
that finds too little waits, one that can never fit fails at once naming the setting); after
"done" the landed pages are copied out (every full-layer page, the window's pages of the
sliding layers) before the request is READY; and every end path gives the pages back only once
the peer stopped writing: done, failed, client abort mid-transfer, drain. The books balance
after every step."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from decode_worker.core.admission import Admit
from decode_worker.core.request import RequestState
from decode_worker.core.sampling import SamplingParams
from decode_worker.daemon.decode.bridge import AddRequest
from decode_worker.daemon.decode.fetcher import AuxBuffers, KVFetcher
from decode_worker.daemon.decode.landing import LandingDock
from decode_worker.daemon.decode.live import LiveRequest
from decode_worker.daemon.decode.parking import Wait
from decode_worker.daemon.decode.requests import RequestTable
from decode_worker.device.aux_rows import FirstToken
from decode_worker.device.kv_pool import KVPools, KVSpec
from decode_worker.device.landing import LandingArea
from decode_worker.device.model.arch import FULL, SLIDING
from decode_worker.io.kv.peer import TransferEvent
from tests.fakes.fake_receiver import FakeReceiver

PS = 4
LAYERS = (SLIDING, FULL, SLIDING)  # model layer 1 is the full one


class Rig:
    """A request table whose fetcher lands SGLang transfers in a 4-page landing area."""

    def __init__(self) -> None:
        self.pools = KVPools(KVSpec(LAYERS, 1, 2), 16, 16, PS, "cpu", torch.float32)
        self.dock = LandingDock(LandingArea(self.pools, 4), PS)
        self.router = FakeReceiver()
        first = FirstToken(0, 42, -0.5, [])
        aux: Any = AuxBuffers(SimpleNamespace(num_rows=8, clear=lambda row: None),  # type: ignore[arg-type]
                              SimpleNamespace(clear=lambda row: None,  # type: ignore[arg-type]
                                              check=lambda row, room, top: first))
        kv_ctx: Any = SimpleNamespace(page_size=PS, radix_cache=False,
                                      release=lambda kv, insert: None)
        fetcher = KVFetcher(self.router, aux, kv_ctx, None, None,  # type: ignore[arg-type]
                            sglang_all_layers=True, landing=self.dock)
        batch: Any = SimpleNamespace(leave=lambda live: 0, steps_done=0)
        outbox: Any = SimpleNamespace(put=lambda event: None)
        self.t = RequestTable(kv_ctx, None, None, self.router, fetcher, outbox,  # type: ignore[arg-type]
                              batch)

    def admit(self, rid: str, prompt_len: int, full: list[int], swa: list[int]) -> LiveRequest:
        """An admitted (RESERVED) request of an SGLang peer, fetched now."""
        cmd = AddRequest(rid, list(range(prompt_len)), SamplingParams(max_new_tokens=4), False,
                         "127.0.0.1", 9, 100 + len(self.t.lives), 0.0)
        live = self.t.register(cmd)
        live.req.sglang_page_size = PS
        live.req.transition(RequestState.RESERVED, 0.0, kv=SimpleNamespace())  # type: ignore[arg-type]
        self.t.fetch(live, Admit(live.req, 0, 0, full, swa), 0.0)
        self.check()
        return live

    def event(self, live: LiveRequest, kind: str, tid: int | None = None) -> None:
        tid = tid or live.transfer_id
        assert tid is not None
        self.router.events.append(TransferEvent(kind, tid, live.rid, live.req.room,  # type: ignore[arg-type]
                                                reason="transfer_failed", protocol="sglang"))
        self.t.poll(1.0)
        self.check()

    def check(self) -> None:
        self.t.parked.check_integrity()
        self.dock.book.check_integrity(self.t.parked.transfer_ids())

    def waiting(self) -> list[str]:
        return [rec.live.rid for rec in self.t.parked.at(Wait.LANDING)]

    @property
    def free(self) -> int:
        return self.dock.book.num_free


def test_room_is_bounded_taken_in_order_and_copied_out_before_ready() -> None:
    rig = Rig()
    a = rig.admit("a", 10, [5, 6, 7], [9, 10])  # 3 pages; the window: its last 2
    sent = rig.router.submitted[1]
    lids = sent["full_page_ids"]
    assert len(lids) == 3 and sent["swa_page_ids"] == [] and rig.free == 1
    b = rig.admit("b", 8, [1, 2], [3, 4])  # 2 pages: 1 free, it waits
    c = rig.admit("c", 4, [3], [5])  # 1 page would fit, but it waits behind b
    assert rig.waiting() == ["b", "c"] and len(rig.router.submitted) == 1
    assert b.req.state is RequestState.RESERVED and b.transfer_id is None
    area = rig.dock.area.tensor  # [layers, pages + 1, 2, PS, 1, 2]
    area[:, lids] = torch.arange(3 * 3 * 16, dtype=torch.float32).view(3, 3, 2, PS, 1, 2)
    landed = area[:, lids].clone()
    rig.event(a, "done")
    assert a.req.state is RequestState.READY and a.req.output_ids == [42]
    assert torch.equal(rig.pools.full[0, [5, 6, 7]], landed[1])  # every page of the full layer
    assert torch.equal(rig.pools.swa[:, [9, 10]], landed[[0, 2]][:, 1:])  # the window only
    assert rig.waiting() == [] and b.transfer_id == 2 and c.transfer_id == 3 and rig.free == 1


def test_every_end_path_gives_the_pages_back_once_the_peer_stopped() -> None:
    rig = Rig()
    failed, aborted = rig.admit("f", 8, [1, 2], [3, 4]), rig.admit("x", 8, [5, 6], [7, 8])
    queued = rig.admit("q", 4, [9], [10])
    assert rig.free == 0 and rig.waiting() == ["q"]
    rig.event(failed, "failed")  # answered now; the peer may still write its pages
    assert failed.ended is not None and failed.ended.reason == "transfer_failed"
    assert rig.free == 0
    rig.event(failed, "released", tid=1)
    assert rig.free == 1 and queued.transfer_id == 3  # its room went to the one waiting
    rig.t.end(aborted, "client_abort", "aborted: client_abort", 2.0)  # mid-transfer
    assert rig.router.aborted == [1, 2] and rig.free == 1
    rig.event(aborted, "released", tid=2)
    assert rig.free == 3
    waiter = rig.admit("w", 16, [11, 12, 13, 14], [15])  # 4 pages, 3 free: waits
    assert rig.waiting() == ["w"]
    for live in list(rig.t.lives.values()):  # drain: the waiter leaves at once
        rig.t.end(live, "drain", "aborted: drain", 3.0)
    rig.check()
    assert waiter.parked is None and rig.router.aborted == [1, 2, 3] and rig.free == 3
    rig.event(queued, "done", tid=3)  # a done transfer of an ended request: no copy, freed
    assert rig.free == 4 and not rig.t.parked and not rig.t.lives


def test_a_transfer_that_can_never_fit_fails_at_once_naming_the_setting() -> None:
    rig = Rig()
    big = rig.admit("big", 17, [1, 2, 3, 4, 5], [6, 7])  # 5 pages > the area's 4
    assert big.ended is not None and big.ended.reason == "transfer_failed"
    assert "transfer.sglang_landing_tokens" in big.ended.message
    assert not rig.router.submitted and rig.free == 4 and not rig.t.parked
    assert big.req.state is RequestState.FAILED


def test_the_landing_area_is_sized_in_pages_and_taken_out_of_a_derived_budget() -> None:
    from decode_worker.daemon.shared.landing_plan import budget_less_landing, landing_pages
    from decode_worker.settings import load_settings

    def settings(**overrides: object) -> Any:
        return load_settings(overrides={"cache.page_size": 16, **overrides}, environ={}).settings

    s = settings(**{"transfer.sglang_landing_tokens": 100})
    assert landing_pages(s, sglang_ordinary=True) == 7  # 100 tokens: 7 pages of 16
    assert landing_pages(s, sglang_ordinary=False) == 0  # SGLang sends SWA state: no landing
    assert landing_pages(settings(**{"transfer.peer_protocol": "native"}), True) == 0
    assert landing_pages(settings(**{"transfer.sglang_landing_tokens": 0}), True) == 0
    spec = KVSpec(LAYERS, 1, 2)  # a page of every layer: 3 x 16 x 2 x 2 x 4 B = 768 B
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert budget_less_landing(None, 7, s, spec, cpu, torch.float32) == (
        s.cache.cpu_pool_bytes - 8 * 768)  # dummy page 0 included
    assert budget_less_landing(10_000, 7, s, spec, cuda, torch.float32) == 10_000 - 8 * 768
    assert budget_less_landing(None, 7, s, spec, cuda, torch.float32) is None  # explicit sizes
    assert budget_less_landing(5_000, 0, s, spec, cpu, torch.float32) == 5_000
