"""The router's and operators' endpoints beside generation: GET /get_load and /flush_cache.

Shaped as SGLang's HTTP server answers them, because the SGLang router and operators' scripts
drive them exactly so:
- `GET /get_load` -> 200, a JSON list with one object per data-parallel rank (one here):
  `[{"dp_rank": 0, "num_reqs": R+W, "num_waiting_reqs": W, "num_tokens": T, "ts_tic": t}]`.
  The router (power_of_two) sums `num_tokens` over the list; it asks without credentials
  unless it was given the worker's key, so the endpoint is open like /server_info.
- `GET|POST /flush_cache[?timeout=S]` -> 200 with SGLang's plain-text answer when the cache was
  flushed; 400 (JSON error, reason `not_idle`) when requests are running or waiting, after
  retrying for up to `timeout` seconds (default 0: one try). Needs the API key when one is set.
"""

from __future__ import annotations

import asyncio
import time
from urllib.parse import parse_qs

from decode_worker.errors import ClientError
from decode_worker.io.api.common import error_obj
from decode_worker.io.api.context import ApiContext
from decode_worker.io.api.message import Request, Response

FLUSHED_TEXT = ("Cache flushed.\nPlease check backend logs for more details. (When there are "
                "running or waiting requests, the operation will not be performed.)\n")
MAX_FLUSH_TIMEOUT_S = 3600.0
_RETRY_S = 0.05  # between tries while a flush with a timeout waits for the worker to go idle


async def handle_get_load(app: ApiContext, req: Request) -> Response:
    load = app.backend.load()
    return Response.json([{
        "dp_rank": 0,
        "num_reqs": load.num_running_reqs + load.num_waiting_reqs,
        "num_waiting_reqs": load.num_waiting_reqs,
        "num_tokens": load.num_tokens,
        "ts_tic": load.measured_at,
    }])


async def handle_flush_cache(app: ApiContext, req: Request) -> Response:
    """Ask the backend to flush; while it refuses (busy) and `timeout` allows, ask again."""
    deadline = time.monotonic() + flush_timeout_s(req.query)
    while True:
        result = await app.backend.flush_cache()
        if result.ok:
            return Response.text(FLUSHED_TEXT)
        left = deadline - time.monotonic()
        if left <= 0:
            message = result.message or "cache not flushed: requests are running or waiting"
            return Response.json(error_obj(message, 400, "not_idle"), 400)
        await asyncio.sleep(min(_RETRY_S, left))


def flush_timeout_s(query: str) -> float:
    """The `timeout` query parameter in seconds (0 when absent). Raises ClientError unless it is
    a number in [0, MAX_FLUSH_TIMEOUT_S]."""
    values = parse_qs(query).get("timeout")
    if not values:
        return 0.0
    try:
        timeout = float(values[-1])
    except ValueError:
        raise ClientError(f"timeout must be a number of seconds, got {values[-1][:40]!r}") from None
    if not 0.0 <= timeout <= MAX_FLUSH_TIMEOUT_S:  # also false for NaN
        raise ClientError(f"timeout must be in [0, {MAX_FLUSH_TIMEOUT_S:g}] seconds")
    return timeout
