"""`WritesInFlight`: before a transfer is posted, the host thread waits only for the writes
that still read one of the transfer's device pages (and, since one stream runs the writes in
order, waiting on the newest such write covers the older ones); a write that reads none of
them, or that is done, costs no wait."""

from __future__ import annotations

from decode_worker.device.host_pool import WritesInFlight


class FakeEvent:
    """A CUDA event's two calls, on a flag the test flips (no CUDA here)."""

    def __init__(self, log: list[str], name: str) -> None:
        self.log, self.name, self.done = log, name, False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.log.append(self.name)
        self.done = True


def _writes(*pages: list[int]) -> tuple[WritesInFlight, list[FakeEvent], list[str]]:
    log: list[str] = []
    w = WritesInFlight()
    events = [FakeEvent(log, f"w{i}") for i in range(len(pages))]
    for ev, p in zip(events, pages, strict=True):
        w.add(ev, p)
    return w, events, log


def test_no_wait_when_no_write_reads_the_pages() -> None:
    w, _, log = _writes([1, 2], [3, 4])
    assert w.wait_for([5, 6, 7]) is False
    assert log == [] and len(w) == 2


def test_waits_on_the_newest_write_that_reads_a_page_and_forgets_the_older_ones() -> None:
    w, _, log = _writes([1, 2], [3, 4], [5], [9])
    assert w.wait_for([4, 8]) is True
    assert log == ["w1"]  # w0 ran before w1 on the same stream
    assert len(w) == 2  # w2 and w3 are still in flight
    assert w.wait_for([5]) is True and log == ["w1", "w2"]
    assert len(w) == 1


def test_done_writes_are_reaped_without_a_wait() -> None:
    w, events, log = _writes([1, 2], [3])
    events[0].done = events[1].done = True
    assert w.wait_for([1, 3]) is False
    assert log == [] and len(w) == 0


def test_wait_all_waits_on_the_newest() -> None:
    w, _, log = _writes([1], [2], [3])
    w.wait_all()
    assert log == ["w2"] and len(w) == 0
    w.wait_all()  # nothing in flight: no call
    assert log == ["w2"]
