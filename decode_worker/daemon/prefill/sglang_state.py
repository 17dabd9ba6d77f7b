"""Book-keeping of the SGLang-protocol prefill peer: a room's two halves and its aborts.

A room starts once it holds its prompt (our HTTP /generate) and `required_dst_info_num`
TransferInfos (from distinct decode agents), in either order, as SGLang's prefill marks a room
WaitingForInput. An ABORT (docs/PROTOCOLS.md, "Abort") of a room that has not
started removes it and is acked at once; of a started room it marks it, and the ack waits until
nothing of the room is in flight. A prompt whose room was aborted before the prompt came fails
at once (a tombstone, kept `timeout_s`). Plain records; the caller (`SglangPrefillPeer`) holds
its lock around every `RoomTable` call.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from decode_worker.core.sampling import SamplingParams
from decode_worker.daemon.prefill.state import OnDone, RoomPrompt
from decode_worker.io.kv.sglang.frames import Abort, TransferInfo

ABORTED = "Aborted by decode-side abort notification."  # SGLang's reason text
Endpoint = tuple[str, int]


@dataclass
class Room(RoomPrompt):
    """One bootstrap room. `started`: handed to the compute thread (its prompt and infos no
    longer change); `aborted` / `acks` (decode endpoint -> abort generation): an ABORT came
    while started."""

    infos: dict[str, TransferInfo] = field(default_factory=dict)  # by decode agent name
    started: bool = False
    aborted: bool = False
    acks: dict[Endpoint, int] = field(default_factory=dict)

    def is_complete(self) -> bool:
        if self.prompt is None or not self.infos:
            return False
        required = max(info.required_dst_info_num for info in self.infos.values())
        return len(self.infos) >= required

    def targets(self) -> list[Endpoint]:
        """Decode endpoints to tell the room's status (every non-dummy info's), in order."""
        out: list[Endpoint] = []
        for info in self.infos.values():
            if not info.is_dummy and (info.ip, info.port) not in out:
                out.append((info.ip, info.port))
        return out


@dataclass
class Outcome:
    """What one table call asks the caller to do: start a room, fail the HTTP halves of
    rooms (room, reason; decode sides are not told), ack aborts now (endpoint, room,
    generation)."""

    start: Room | None = None
    fail: list[tuple[Room, str]] = field(default_factory=list)
    acks: list[tuple[Endpoint, int, int]] = field(default_factory=list)


class RoomTable:
    """Rooms by id; a room leaves on `finish` (after it ran), `abort` or `expire`."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.rooms: dict[int, Room] = {}
        self.tombstones: dict[int, float] = {}  # room aborted before its prompt -> when

    def add_prompt(self, room: int, prompt: list[int], on_done: OnDone | None,
                   sampling: SamplingParams | None, now: float) -> Outcome:
        """The HTTP half. A second prompt for a waiting room replaces the first (which fails);
        one for a started room fails itself."""
        if self.tombstones.pop(room, None) is not None:
            return Outcome(fail=[(Room(room, now, prompt, on_done), ABORTED)])
        r = self.rooms.setdefault(room, Room(room, now))
        if r.started:
            return Outcome(fail=[(Room(room, now, prompt, on_done), f"room {room} is already "
                                  "being prefilled")])  # fmt: skip
        out = Outcome()
        if r.prompt is not None and r.on_done is not None:
            out.fail.append((Room(room, r.arrived_at, r.prompt, r.on_done),
                             "replaced by a newer request for the same room"))
        r.prompt, r.on_done, r.sampling = prompt, on_done, sampling
        out.start = self._maybe_start(r)
        return out

    def add_info(self, info: TransferInfo, now: float) -> Outcome:
        """A decode agent's TransferInfo; one for a started room is ignored (None start)."""
        self.tombstones.pop(info.room, None)
        r = self.rooms.setdefault(info.room, Room(info.room, now))
        if r.started:
            return Outcome()
        r.infos[info.agent_name] = info
        return Outcome(start=self._maybe_start(r))

    def _maybe_start(self, r: Room) -> Room | None:
        if r.is_complete():
            r.started = True
            return r
        return None

    def abort(self, a: Abort, now: float) -> Outcome:
        """An ABORT from a decode side (`a.ip`/`port`/`generation` absent: no ack wanted)."""
        target = None if a.ip is None or a.port is None or a.generation is None else (
            (a.ip, a.port), a.generation)  # fmt: skip
        r = self.rooms.get(a.room)
        if r is not None and r.started:
            r.aborted = True
            if target is not None:
                r.acks[target[0]] = target[1]
            return Outcome()
        out = Outcome(acks=[] if target is None else [(target[0], a.room, target[1])])
        if r is None or r.prompt is None:
            self.tombstones[a.room] = now
        if r is not None:
            del self.rooms[a.room]
            out.fail.append((r, ABORTED))
        return out

    def finish(self, r: Room) -> list[tuple[Endpoint, int, int]]:
        """Forget a room that ran; its due abort acks (nothing of it is in flight now)."""
        if self.rooms.get(r.room) is r:
            del self.rooms[r.room]
        return [(target, r.room, gen) for target, gen in r.acks.items()] if r.aborted else []

    def is_aborted(self, r: Room) -> bool:
        return r.aborted

    def expire(self, now: float) -> list[Room]:
        """Remove and return the rooms that waited `timeout_s` for their other half; drop old
        tombstones."""
        old = [k for k, r in self.rooms.items()
               if not r.started and now - r.arrived_at > self.timeout_s]
        for room in [k for k, t in self.tombstones.items() if now - t > self.timeout_s]:
            del self.tombstones[room]
        return [self.rooms.pop(k) for k in old]
