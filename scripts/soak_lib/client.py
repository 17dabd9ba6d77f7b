"""One HTTP request of the soak, classified by how (whether) it was answered.

An `Answer` is one of:
- `tokens`: 200 with output tokens (a stream: events with tokens, no error event, `[DONE]`);
- `error`: a status >= 400 with a body, a stream's error event, or 200 without any token;
- `refused`: the connection was refused (the server was not listening: never accepted);
- `dropped`: the connection broke before any status line (accepted, then the server went);
  whether these two count as answers is the caller's decision (`Tally.record`), by whether
  the server was being stopped on purpose at that moment;
- `cut`: a 200 stream that ended without `[DONE]` (silently cut: never an answer);
- `malformed`: a 200 stream with an event that is not JSON (never an answer: a server bug);
- `timeout`: nothing conclusive before the deadline (never an answer);
- `crashed`: the soak itself failed while sending it (never an answer: `Traffic` records it).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx

KINDS = ("tokens", "error", "refused", "dropped", "cut", "malformed", "timeout", "crashed")


@dataclass(frozen=True)
class Answer:
    kind: str  # one of KINDS
    status: int | None = None
    detail: str = ""
    started_at: float = 0.0  # monotonic
    num_tokens: int = 0
    ended_at: float = 0.0  # monotonic, set for `refused`


def post(url: str, body: dict[str, Any] | bytes, deadline_s: float = 60.0,
         headers: dict[str, str] | None = None) -> Answer:
    """POST `body` (JSON, or raw bytes as given) to `url`; stream if body["stream"]."""
    started = time.monotonic()
    stream = isinstance(body, dict) and bool(body.get("stream"))
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    timeout = httpx.Timeout(deadline_s, connect=5.0)
    hdrs = {"content-type": "application/json", **(headers or {})}
    try:
        with httpx.Client(timeout=timeout) as client, client.stream(
                "POST", url, content=content, headers=hdrs) as resp:
            if stream and resp.status_code == 200:
                return _read_stream(resp, started, deadline_s)
            raw = resp.read()
            return _plain(resp.status_code, raw, started)
    except httpx.TimeoutException as exc:
        return Answer("timeout", None, repr(exc), started)
    except httpx.ConnectError as exc:
        return Answer("refused", None, repr(exc), started, ended_at=time.monotonic())
    except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as exc:
        return Answer("dropped", None, repr(exc), started)


def _plain(status: int, raw: bytes, started: float) -> Answer:
    try:
        doc = json.loads(raw) if raw else None
    except ValueError:
        doc = None
    if status >= 400:
        return Answer("error", status, raw[:200].decode(errors="replace"), started)
    n = _count_tokens(doc)
    return Answer("tokens" if n else "error", status, "" if n else "200 without tokens",
                  started, n)


def sse_lines(resp: httpx.Response) -> Iterator[str]:
    """The stream's lines as SSE ends them: at LF (or CRLF) only. httpx's `iter_lines` splits
    like `str.splitlines`, also at NEL, LINE SEPARATOR and the like, which a JSON string may
    hold raw: it would cut an event in two."""
    pending = b""
    for chunk in resp.iter_bytes():
        *lines, pending = (pending + chunk).split(b"\n")
        for line in lines:
            yield line.removesuffix(b"\r").decode("utf-8", errors="replace")
    if pending:
        yield pending.removesuffix(b"\r").decode("utf-8", errors="replace")


def _read_stream(resp: httpx.Response, started: float, deadline_s: float) -> Answer:
    tokens, error, done = 0, "", False
    try:
        for line in sse_lines(resp):
            if time.monotonic() - started > deadline_s:
                return Answer("timeout", 200, "stream past the deadline", started, tokens)
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                done = True
                break
            try:
                event = json.loads(payload)
            except ValueError:
                return Answer("malformed", 200, f"after {tokens} tokens: {payload[:120]!r}",
                              started, tokens)
            if isinstance(event, dict) and "error" in event:
                error = str(event["error"].get("message", event["error"]))[:200]
            tokens = max(tokens, _count_tokens(event))
    except (httpx.RemoteProtocolError, httpx.ReadError) as exc:
        return Answer("cut", 200, f"after {tokens} tokens: {exc!r}", started, tokens)
    if not done:
        return Answer("cut", 200, f"no [DONE] after {tokens} tokens", started, tokens)
    if error:
        return Answer("error", 200, error, started, tokens)
    return Answer("tokens" if tokens else "error", 200, "", started, tokens)


def _count_tokens(doc: Any) -> int:
    """Output tokens in one answer or stream event of /generate or the OpenAI routes (for a
    stream, an incremental count is at least 1 per event that carries text)."""
    if isinstance(doc, list):
        return sum(_count_tokens(d) for d in doc)
    if not isinstance(doc, dict):
        return 0
    if isinstance(doc.get("output_ids"), list):
        return len(doc["output_ids"])
    usage = doc.get("usage")
    if isinstance(usage, dict) and usage.get("completion_tokens"):
        return int(usage["completion_tokens"])
    n = 0
    for choice in doc.get("choices") or []:
        delta = choice.get("delta") or choice.get("message") or {}
        if choice.get("text") or (isinstance(delta, dict) and delta.get("content")):
            n += 1
    return n
