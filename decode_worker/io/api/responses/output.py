"""Harmony parser deltas -> Responses output items and stream events (pure, no I/O).

`OutputBuilder` is fed the deltas of the shared harmony parser (`harmony/parser.py`, the one
chat uses) step by step and returns the stream events each step completes; its `output()` is
the `output` list of the answer. A plain answer is the same builder fed the whole output at
once, so a stream and a plain answer cannot disagree.

Items, in the order the model wrote them (one per run of deltas of one kind):
- `reasoning` (analysis channel): `content` [{"type": "reasoning_text", "text"}], `summary` [];
- `message` (final channel, or commentary without a recipient): `content` [{"type":
  "output_text", "text", "annotations": [], "logprobs": []}];
- `function_call` (commentary to functions.NAME): `call_id`, `name`, `arguments` (JSON text).
An item's `status` is `completed`, or `incomplete` when the answer was cut inside it (a call
is complete only once its `<|call|>` came).

Events per item (OpenAI's names; every event has a `sequence_number`, counted by the builder
across the whole stream, lifecycle events included):
    response.output_item.added
    text items: response.content_part.added, response.{output_text|reasoning_text}.delta ...,
                response.{output_text|reasoning_text}.done, response.content_part.done
    calls:      response.function_call_arguments.delta ..., response.function_call_arguments.done
    response.output_item.done
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from decode_worker.io.api.harmony.parser import Delta, Parsed

Event = dict[str, Any]
_PREFIX = {"reasoning": "rs", "message": "msg", "function_call": "fc"}
_KIND = {"reasoning": "reasoning", "content": "message"}


def new_item_id(kind: str) -> str:
    return f"{_PREFIX[kind]}_{uuid.uuid4().hex}"


@dataclass(slots=True)
class Item:
    """One output item being built. `text`: the reasoning or message text, or the arguments."""

    kind: str  # reasoning | message | function_call
    id: str
    text: str = ""
    name: str = ""
    call_id: str = ""
    call_index: int = -1  # the parser's index of the call
    status: str = "in_progress"

    def as_dict(self, shown: bool = True) -> dict[str, Any]:
        """The item as the API shows it (`shown` False: as first announced, without text)."""
        text = self.text if shown else ""
        base: dict[str, Any] = {"id": self.id, "type": self.kind, "status": self.status}
        if self.kind == "function_call":
            return {**base, "call_id": self.call_id, "name": self.name, "arguments": text}
        if self.kind == "reasoning":
            content = [_part(self.kind, text)] if shown else []
            return {**base, "summary": [], "content": content}
        content = [_part(self.kind, text)] if shown else []
        return {**base, "role": "assistant", "content": content}


def _part(kind: str, text: str) -> dict[str, Any]:
    if kind == "reasoning":
        return {"type": "reasoning_text", "text": text}
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


class OutputBuilder:
    """Builds the output items and events of one answer. Not thread-safe."""

    def __init__(self, new_id: Callable[[str], str] = new_item_id) -> None:
        self._new_id = new_id
        self.items: list[Item] = []
        self._open: Item | None = None
        self._seq = 0

    def event(self, kind: str, **fields: Any) -> Event:
        """An event with the next sequence number."""
        ev = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return ev

    def add(self, deltas: list[Delta], parsed: Parsed | None) -> list[Event]:
        """The events of one step's deltas; a call whose `<|call|>` came (in `parsed`) is done."""
        out: list[Event] = []
        for d in deltas:
            if d.kind == "call":
                out += self._start(Item("function_call", self._new_id("function_call"),
                                        name=d.text, call_id=d.call_id, call_index=d.index))
            elif d.kind == "args":
                out += self._args(d)
            elif d.text:
                out += self._text(_KIND[d.kind], d.text)
        item = self._open
        if item is not None and item.kind == "function_call" and parsed is not None and (
                parsed.calls[item.call_index].complete):
            out += self._close("completed")
        return out

    def finish(self, cut: bool) -> list[Event]:
        """The end of the answer: the open item is done (`incomplete` when `cut`)."""
        status = "completed"
        if self._open is not None and (cut or self._open.kind == "function_call"):
            status = "incomplete"  # a call still open never got its <|call|>
        return self._close(status)

    def output(self) -> list[dict[str, Any]]:
        return [item.as_dict() for item in self.items]

    # -- items ------------------------------------------------------------------------------

    def _text(self, kind: str, text: str) -> list[Event]:
        out: list[Event] = []
        item = self._open
        if item is None or item.kind != kind:
            item = Item(kind, self._new_id(kind))
            out += self._start(item)
        item.text += text
        name = "reasoning_text" if kind == "reasoning" else "output_text"
        extra: dict[str, Any] = {"logprobs": []} if kind == "message" else {}
        out.append(self.event(f"response.{name}.delta", **self._where(item), content_index=0,
                              delta=text, **extra))
        return out

    def _args(self, d: Delta) -> list[Event]:
        item = self._open
        if item is None or item.kind != "function_call" or item.call_index != d.index:
            return []  # arguments of a call already closed: cannot happen with the parser
        item.text += d.text
        return [self.event("response.function_call_arguments.delta", **self._where(item),
                           delta=d.text)]

    def _start(self, item: Item) -> list[Event]:
        out = self._close("completed")
        self.items.append(item)
        self._open = item
        out.append(self.event("response.output_item.added", output_index=len(self.items) - 1,
                              item=item.as_dict(shown=False)))
        if item.kind != "function_call":
            out.append(self.event("response.content_part.added", **self._where(item),
                                  content_index=0, part=_part(item.kind, "")))
        return out

    def _close(self, status: str) -> list[Event]:
        item = self._open
        if item is None:
            return []
        self._open = None
        item.status = status
        where = self._where(item)
        out: list[Event] = []
        if item.kind == "function_call":
            out.append(self.event("response.function_call_arguments.done", **where,
                                  name=item.name, arguments=item.text))
        else:
            name = "reasoning_text" if item.kind == "reasoning" else "output_text"
            extra: dict[str, Any] = {"logprobs": []} if item.kind == "message" else {}
            out.append(self.event(f"response.{name}.done", **where, content_index=0,
                                  text=item.text, **extra))
            out.append(self.event("response.content_part.done", **where, content_index=0,
                                  part=_part(item.kind, item.text)))
        out.append(self.event("response.output_item.done", output_index=where["output_index"],
                              item=item.as_dict()))
        return out

    def _where(self, item: Item) -> dict[str, Any]:
        return {"item_id": item.id, "output_index": self.items.index(item)}
