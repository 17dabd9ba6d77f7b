"""The router-compatible HTTP API: routing, auth, health, info, metrics and error mapping.

`ApiApp(backend, config, metrics)` is a handler (`message.Handler`; served by `asgi.py`). Routes:
  POST /generate, /v1/completions, /v1/chat/completions     (generation; auth; 503 when draining)
  POST /v1/responses                                        (the same; `responses/`)
  GET|DELETE /v1/responses/{id}, POST .../{id}/cancel       (404: nothing is stored)
  GET  /health, /health_generate                            (200, or 503 + Retry-After)
  GET  /server_info, /get_server_info, /model_info, /get_model_info, /v1/models, /metrics
  GET  /get_load; GET or POST /flush_cache (auth)            (router and operators: `admin.py`)
  GET  /v1/loads                                            (SGLang's load report: `loads.py`)
Every error is `{"error": {"message", "type", "code", "reason"}}` with a matching status.
`/health_generate` reports backend health without generating (a decode worker cannot
generate without a prefill peer).
"""

from __future__ import annotations

import hmac
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from decode_worker.core.sampling import SamplingParams
from decode_worker.errors import AdmissionRejected, ClientError, Draining, ServiceUnavailable
from decode_worker.io.api.admin import handle_flush_cache, handle_get_load
from decode_worker.io.api.backend import GenerateBackend, GenerateInput, abort_label
from decode_worker.io.api.chat import handle_chat
from decode_worker.io.api.common import ApiConfig, error_obj, new_rid, now_s
from decode_worker.io.api.generate import handle_generate
from decode_worker.io.api.harmony.chat import check_parsers
from decode_worker.io.api.limits import check_model, resolve_max_new_tokens
from decode_worker.io.api.loads import handle_v1_loads
from decode_worker.io.api.message import Request, Response, StreamResponse
from decode_worker.io.api.openai import handle_completions
from decode_worker.io.api.responses import PREFIX, handle_responses, handle_stored
from decode_worker.io.api.run import GenerationRun, RejectedAtStart
from decode_worker.io.api.targets import Target, body_targets
from decode_worker.io.metrics import Metrics

log = logging.getLogger(__name__)
Reply = Response | StreamResponse
Route = Callable[["ApiApp", Request], Awaitable[Reply]]
# 503 while draining
GENERATION = frozenset({"generate", "completions", "chat_completions", "responses"})
# need the API key when one is set
AUTHED = GENERATION | {"models", "flush_cache", "stored_response"}


class ApiApp:
    """HTTP handler over a `GenerateBackend`. Runs on the event loop; holds no locks.

    Implements `context.ApiContext` (what the endpoint modules use: backend, config, metrics,
    make_input, start_run, model_name, check_model, max_new_tokens); the endpoints never import
    this module. `/server_info` and `/model_info` add `served_model_name` (`model_name`).
    Raises ConfigError for a reasoning / tool-call parser setting the tokenizer cannot serve."""

    def __init__(
        self, backend: GenerateBackend, config: ApiConfig, metrics: Metrics | None = None
    ) -> None:
        check_parsers(config.reasoning_parser, config.tool_call_parser, backend.tokenizer)
        self.backend = backend
        self.config = config
        self.metrics = metrics
        self._live: set[str] = set()  # internal rids of runs in flight (kept unique)
        # path -> (methods, endpoint name for metrics, handler); a GET-only route takes HEAD too
        self._routes: dict[str, tuple[tuple[str, ...], str, Route]] = {
            "/generate": (("POST",), "generate", handle_generate),
            "/v1/completions": (("POST",), "completions", handle_completions),
            "/v1/chat/completions": (("POST",), "chat_completions", handle_chat),
            "/v1/responses": (("POST",), "responses", handle_responses),
            "/health": (("GET",), "health", ApiApp._health),
            "/health_generate": (("GET",), "health_generate", ApiApp._health),
            "/server_info": (("GET",), "server_info", ApiApp._server_info),
            "/get_server_info": (("GET",), "server_info", ApiApp._server_info),
            "/model_info": (("GET",), "model_info", ApiApp._model_info),
            "/get_model_info": (("GET",), "model_info", ApiApp._model_info),
            "/v1/models": (("GET",), "models", ApiApp._models),
            "/metrics": (("GET",), "metrics", ApiApp._metrics),
            "/get_load": (("GET",), "get_load", handle_get_load),
            "/v1/loads": (("GET",), "loads", handle_v1_loads),
            "/flush_cache": (("GET", "POST"), "flush_cache", handle_flush_cache),
        }

    async def __call__(self, req: Request) -> Reply:
        route = self._routes.get(req.path)
        if route is None and req.path.startswith(PREFIX):
            route = (("GET", "DELETE", "POST"), "stored_response", handle_stored)
        endpoint = route[1] if route is not None else "other"
        try:
            reply = await self._route(req, route)
        except Exception as exc:
            reply = _error_reply(exc, req)
            if endpoint in GENERATION:
                self._refuse(req, exc, reply.status)
        if self.metrics is not None:
            self.metrics.inc_http(endpoint, reply.status)
        return reply

    async def _route(
        self, req: Request, route: tuple[tuple[str, ...], str, Route] | None
    ) -> Reply:
        if route is None:
            return _json_error(404, f"no route for {req.path[:200]}", "not_found")
        methods, endpoint, handler = route
        allowed = (*methods, "HEAD") if methods == ("GET",) else methods
        if req.method not in allowed:
            return _json_error(405, f"{req.method} not allowed on {req.path}", "bad_request",
                               [("allow", ", ".join(allowed))])
        if endpoint in AUTHED:
            self._check_auth(req)
        if endpoint in GENERATION:
            self.check_serving()
        return await handler(self, req)

    def _check_auth(self, req: Request) -> None:
        self.check_api_key(req.header("authorization"))

    def check_api_key(self, authorization: str | None) -> None:
        """Raise AuthError (401) unless `authorization` is `Bearer <api_key>` (no key set: any
        value passes). The gRPC servicer checks its `authorization` metadata with this too."""
        key = self.config.api_key
        if key is None:
            return
        given = authorization or ""
        if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
            raise AuthError("missing or wrong API key (Authorization: Bearer ...)")

    def check_serving(self) -> None:
        """Raise ServiceUnavailable (with `retry_after_s`) unless the backend takes new work:
        the refusal every generation door gives while draining or unhealthy (HTTP 503, gRPC
        UNAVAILABLE)."""
        health = self.backend.health()
        if not health.accepts_work:
            kind = Draining if health.status == "draining" else ServiceUnavailable
            exc = kind(health.message or f"worker is {health.status}")
            exc.retry_after_s = health.retry_after_s  # type: ignore[attr-defined]
            raise exc

    def _refuse(self, req: Request, exc: Exception, status: int) -> None:
        """A generation request answered `status` for `exc` before the backend started it:
        `backend.refuse` counts it and ends its rooms at their prefill peers (the rooms the body
        names: `body_targets`). Not for a 401 (an unauthenticated body ends nothing) nor for a
        request the backend ended itself (`RejectedAtStart`: its first chunk was the error)."""
        if isinstance(exc, AuthError | RejectedAtStart):
            return
        label = abort_label(reason_of(exc), status)
        self.backend.refuse(body_targets(req.body) or [Target()], label, str(exc)[:512])

    # -- used by the endpoint modules ------------------------------------------------------

    def make_input(
        self, rid: str | None, ids: list[int], sampling: SamplingParams, target: Target,
        *, stream: bool, return_logprob: bool, endpoint: str, received_at: float = 0.0,
        top_logprobs: int = 0,
    ) -> GenerateInput:
        """A GenerateInput whose `rid` is unique among live runs (the client's rid if free:
        router retries resend the same rid while the first attempt may still wait for KV)."""
        client_rid = rid or new_rid()
        internal = client_rid if client_rid not in self._live else f"{client_rid}-{new_rid()[:8]}"
        return GenerateInput(
            rid=internal, input_ids=ids, sampling=sampling, stream=stream,
            return_logprob=return_logprob, top_logprobs=top_logprobs if return_logprob else 0,
            bootstrap_host=target.host, bootstrap_port=target.port, bootstrap_room=target.room,
            received_at=received_at or time.monotonic(), endpoint=endpoint,
            extra={"client_rid": client_rid},
        )

    async def start_run(self, inp: GenerateInput) -> GenerationRun:
        """Submit to the backend and wait for its first chunk (errors raise: answered 4xx/5xx)."""
        metrics = self.metrics if self.config.observe_latency else None
        run = _TrackedRun(self.backend, inp, metrics, self._live)
        await run.start()
        await run.reject_if_failed_at_start()
        return run

    def model_name(self) -> str:
        """The one name both servers answer with: `model.served_model_name` if set, else the
        model path (SGLang's default), else "default"."""
        if self.config.served_model_name:
            return self.config.served_model_name
        path = self.backend.server_info().get("model_path")
        return str(path) if path else "default"

    def check_model(self, requested: str | None) -> None:
        """Raise ModelNotFound (404) for a `model` other than ours (unless not strict)."""
        check_model(requested, self.model_name(), self.config.strict_model_name)

    def max_new_tokens(self, prompt_tokens: int, requested: int | None,
                       default: int | None) -> int:
        """The limit to run with (`limits.resolve_max_new_tokens`; `default` None: up to the
        context). Raises ClientError (400) when it does not fit the model's context."""
        ctx = self.backend.server_info().get("context_length")
        return resolve_max_new_tokens(
            prompt_tokens, requested, ctx if isinstance(ctx, int) and ctx > 0 else None,
            default=default, fallback=self.config.default_max_new_tokens)

    # -- small endpoints -------------------------------------------------------------------

    async def _health(self, req: Request) -> Reply:
        health = self.backend.health()
        if health.is_ok:
            return Response(200, b"", "text/plain; charset=utf-8")
        return _json_error(503, health.message or health.status, health.status,
                           [("retry-after", str(health.retry_after_s))])

    def server_info(self) -> dict[str, Any]:
        """What GET /server_info (and gRPC GetServerInfo) reports: the backend's facts over
        the cache settings, plus `served_model_name`."""
        info = {**self.config.server_info_defaults, **self.backend.server_info()}
        return {**info, "served_model_name": self.model_name()}

    async def _server_info(self, req: Request) -> Reply:
        return Response.json(self.server_info())

    async def _model_info(self, req: Request) -> Reply:
        return Response.json({**self.backend.model_info(), "served_model_name": self.model_name()})

    async def _models(self, req: Request) -> Reply:
        info = self.backend.server_info()
        card = {"id": self.model_name(), "object": "model", "created": now_s(),
                "owned_by": "decode-worker", "root": str(info.get("model_path", "")),
                "max_model_len": info.get("context_length")}
        return Response.json({"object": "list", "data": [card]})

    async def _metrics(self, req: Request) -> Reply:
        if self.metrics is None or not self.config.metrics_enabled:
            return _json_error(404, "metrics are disabled", "not_found")
        body, content_type = self.metrics.exposition()
        return Response(200, body, content_type)


class _TrackedRun(GenerationRun):
    """A run that keeps its rid in the app's live set until it ends."""

    def __init__(self, backend: GenerateBackend, inp: GenerateInput, metrics: Metrics | None,
                 live: set[str]) -> None:
        super().__init__(backend, inp, metrics)
        self._live = live
        live.add(inp.rid)

    async def start(self) -> None:
        try:
            await super().start()
        except BaseException:
            self._live.discard(self.inp.rid)
            raise

    async def _close_iter(self) -> None:
        self._live.discard(self.inp.rid)
        await super()._close_iter()


class AuthError(ClientError):
    """A generation or admin call without the configured API key."""

    status = 401


def _json_error(status: int, message: str, code: str,
                headers: list[tuple[str, str]] | None = None) -> Response:
    return Response.json(error_obj(message, status, code), status, headers or [])


def reason_of(exc: Exception) -> str:
    """The error body's `reason` for `exc`."""
    if isinstance(exc, ClientError | ServiceUnavailable):
        return exc.reason
    if isinstance(exc, AdmissionRejected):
        return "too_large"
    return exc.code if isinstance(exc, RejectedAtStart) else "internal"


def _error_reply(exc: Exception, req: Request) -> Response:
    if isinstance(exc, ClientError):
        return _json_error(exc.status, str(exc), exc.reason)
    if isinstance(exc, ServiceUnavailable):
        retry = str(getattr(exc, "retry_after_s", 5))
        return _json_error(503, str(exc) or "unavailable", exc.reason, [("retry-after", retry)])
    if isinstance(exc, AdmissionRejected):
        return _json_error(413, str(exc), "too_large")
    if isinstance(exc, RejectedAtStart):
        after = [("retry-after", "5")] if exc.status == 503 else []
        return _json_error(exc.status, str(exc), exc.code, after)
    log.exception("%s %s failed", req.method, req.path)
    return _json_error(500, f"internal error: {type(exc).__name__}", "internal")


def check_model_path(info: dict[str, Any]) -> str | None:
    """A warning if `model_path` is not a local directory holding tokenizer.json (the router
    would then try to download a tokenizer), else None. The daemon logs it at startup."""
    path = info.get("model_path")
    if not path or not (Path(str(path)) / "tokenizer.json").is_file():
        return f"server_info model_path={path!r} is not a local directory with tokenizer.json"
    return None
