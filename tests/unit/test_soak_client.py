"""The soak's client reads SSE as the format defines lines, and its traffic never loses a
request silently: a harness failure is tallied as a loss."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from scripts.soak_lib.client import Answer, sse_lines
from scripts.soak_lib.traffic import State, Tally


def test_sse_lines_end_at_lf_only_whatever_the_chunking() -> None:
    text = "a\u2028b\x85c\u2029d"  # raw in JSON strings; `str.splitlines` would cut at each
    event = b"data: " + json.dumps({"t": text}, ensure_ascii=False).encode() + b"\r\n\r\n"
    body = event + b"data: [DONE]\n\n"
    for chunk in (1, 3, len(body)):
        resp = httpx.Response(200, content=body)
        resp.iter_bytes = lambda c=chunk, b=body: iter(  # type: ignore[method-assign]
            [b[i:i + c] for i in range(0, len(b), c)])
        lines = [ln for ln in sse_lines(resp) if ln]
        assert lines == ["data: " + json.dumps({"t": text}, ensure_ascii=False),
                         "data: [DONE]"], chunk
        assert json.loads(lines[0][6:])["t"] == text


def test_a_crashed_or_malformed_request_counts_as_unanswered() -> None:
    tally = Tally(State())
    for kind in ("crashed", "malformed", "cut", "timeout"):
        assert tally.record("traffic", "decode", Answer(kind)) == "unanswered"
    assert tally.totals()["unanswered"] == 4 and len(tally.lost) == 4
