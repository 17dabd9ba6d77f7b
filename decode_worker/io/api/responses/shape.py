"""One answer of `/v1/responses`: the response object, its status, usage and the stream.

`ResponseShape` turns one run (the decode worker's, or the prefill peer's) into OpenAI's
`response` object. Status: `completed` (the turn ended, or a stop token); `incomplete` with
`incomplete_details.reason` "max_output_tokens" (cut by `max_output_tokens` or the context);
`cancelled` (the server aborted the run without an error); `failed` with `error` (an error
after the stream started: a plain answer is an HTTP error instead, as on chat).
`usage.input_tokens_details.cached_tokens` is the prompt tokens this server reused from its
prefix cache (on the decode worker: the decode-side radix tree), and
`output_tokens_details.reasoning_tokens` the tokens of the analysis channel. The request's
settings are echoed; `store` is always false (nothing is stored, see `schema.py`).

The stream is `event: <type>` + `data: <json>` per event: `response.created`,
`response.in_progress`, the item events (`output.py`), then `response.completed`,
`response.incomplete` or `response.failed` with the whole response (a `cancelled` one ends with
`response.incomplete`: there is no cancelled event; no `[DONE]`: OpenAI sends none for
Responses).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncGenerator
from typing import Any

from decode_worker.io.api.common import json_line
from decode_worker.io.api.harmony.chat import ChatParsing, make_parser
from decode_worker.io.api.harmony.parser import Delta
from decode_worker.io.api.responses.output import Event, OutputBuilder
from decode_worker.io.api.responses.schema import ResponsesReq
from decode_worker.io.api.run import GenerationRun, Step
from decode_worker.io.api.samples import merged_steps


class ResponseShape:
    """The response of one run. `parsing` None: not a harmony model (the text is one message);
    `request` is echoed (tools and tool_choice as the client sent them)."""

    def __init__(self, model: str, request: ResponsesReq, run: GenerationRun,
                 parsing: ChatParsing | None, effort: str | None) -> None:
        self.model, self.request, self.run, self.parsing = model, request, run, parsing
        self.effort = effort
        rid = str(run.inp.extra.get("client_rid", run.inp.rid))
        self.id = rid if rid.startswith("resp_") else f"resp_{rid}"
        self.created_at = time.time()
        self.parser = None if parsing is None else make_parser(parsing, run.backend.tokenizer)
        self.builder = OutputBuilder()
        self.status = "in_progress"
        self.error: dict[str, Any] | None = None

    # -- feeding ----------------------------------------------------------------------------

    def step(self, step: Step) -> list[Event]:
        """The item events of one step (the last step closes the open item)."""
        last = step.finish is not None
        if self.parser is None:
            deltas = [Delta("content", step.text)] if step.text else []
        else:
            deltas = self.parser.push(step.token_ids)
            if last:
                deltas += self.parser.finish()
            if self.parsing is not None and not self.parsing.reasoning:
                deltas = [Delta("content", d.text) if d.kind == "reasoning" else d
                          for d in deltas]
        events = self.builder.add(deltas, self.parser.parsed if self.parser else None)
        if last:
            events += self._end(step)
        return events

    def _end(self, step: Step) -> list[Event]:
        fin = step.finish
        assert fin is not None
        cut = fin.reason != "stop"
        events = self.builder.finish(cut)
        if fin.reason == "error":
            self.status = "failed"
            self.error = {"code": fin.code, "message": fin.message or "internal error"}
        elif fin.reason == "abort":
            self.status = "cancelled"
        else:
            self.status = "incomplete" if fin.reason == "length" else "completed"
        return events

    def run_whole(self) -> dict[str, Any]:
        """After the run was collected: the response (the builder fed all the output)."""
        fin = self.run.finish
        self.step(Step(self.run.text.text, list(self.run.output_ids), finish=fin))
        return self.body()

    # -- the object -------------------------------------------------------------------------

    def body(self) -> dict[str, Any]:
        r = self.request
        incomplete = {"reason": "max_output_tokens"} if self.status == "incomplete" else None
        fmt = (r.text.format if r.text is not None else None) or {"type": "text"}
        return {
            "id": self.id, "object": "response", "created_at": self.created_at,
            "status": self.status, "error": self.error, "incomplete_details": incomplete,
            "model": self.model, "output": self.builder.output(),
            "instructions": r.instructions, "max_output_tokens": r.max_output_tokens,
            "max_tool_calls": r.max_tool_calls,
            "parallel_tool_calls": True if r.parallel_tool_calls is None else r.parallel_tool_calls,
            "previous_response_id": None,
            "reasoning": {"effort": self.effort, "summary": None},
            "store": False, "background": False,
            "temperature": r.temperature, "top_p": r.top_p,
            "text": {"format": fmt}, "tool_choice": r.tool_choice or "auto",
            "tools": r.tools or [], "truncation": r.truncation or "disabled",
            "usage": self.usage() if self.status != "in_progress" else None,
            "user": r.user, "metadata": r.metadata or {},
        }

    def usage(self) -> dict[str, Any]:
        run = self.run
        out = len(run.output_ids)
        reasoning = self.parser.num_reasoning_tokens if self.parser is not None else 0
        return {"input_tokens": run.prompt_tokens,
                "input_tokens_details": {"cached_tokens": run.cached_tokens},
                "output_tokens": out, "output_tokens_details": {"reasoning_tokens": reasoning},
                "total_tokens": run.prompt_tokens + out}

    def lifecycle(self, kind: str) -> Event:
        return self.builder.event(kind, response=self.body())


def sse_event(event: Event) -> bytes:
    return b"event: " + str(event["type"]).encode() + b"\ndata: " + json_line(event) + b"\n\n"


async def stream_events(shape: ResponseShape) -> AsyncGenerator[bytes, None]:
    """The SSE body of one run (see the module doc)."""
    yield sse_event(shape.lifecycle("response.created"))
    yield sse_event(shape.lifecycle("response.in_progress"))
    async with contextlib.aclosing(merged_steps([shape.run])) as steps:
        async for _, step in steps:
            for event in shape.step(step):
                yield sse_event(event)
    terminal = {"completed": "response.completed", "failed": "response.failed"}.get(
        shape.status, "response.incomplete")
    yield sse_event(shape.lifecycle(terminal))
