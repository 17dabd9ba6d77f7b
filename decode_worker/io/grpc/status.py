"""gRPC status codes for what the HTTP routes answer with an HTTP status.

One table for both kinds of refusal: an error raised before a request runs (the API layer's
exceptions) and a request that ended early (an abort reason, docs/CONTRACTS.md). The codes
follow what smg's servicers use for the same HTTP statuses (400 -> INVALID_ARGUMENT, 503 ->
UNAVAILABLE, 429 -> RESOURCE_EXHAUSTED), with two distinctions HTTP folds into one 503:
a full queue is RESOURCE_EXHAUSTED (retry elsewhere now), a draining or dead worker is
UNAVAILABLE.
"""

from __future__ import annotations

from grpc import StatusCode

from decode_worker.errors import AdmissionRejected, ClientError, QueueFull, ServiceUnavailable
from decode_worker.io.api.run import RejectedAtStart

# an abort / failure reason -> its code; reasons not listed go by their HTTP status
_BY_REASON = {
    "bad_request": StatusCode.INVALID_ARGUMENT,
    "too_large": StatusCode.INVALID_ARGUMENT,  # can never fit this worker: no retry helps
    "model_not_found": StatusCode.NOT_FOUND,
    "client_abort": StatusCode.CANCELLED,
    "queue_full": StatusCode.RESOURCE_EXHAUSTED,
    "swa_reclaim_insufficient": StatusCode.RESOURCE_EXHAUSTED,
    "queue_timeout": StatusCode.UNAVAILABLE,
    "drain": StatusCode.UNAVAILABLE,
    "unavailable": StatusCode.UNAVAILABLE,
    "transfer_failed": StatusCode.UNAVAILABLE,
    "peer_dead": StatusCode.UNAVAILABLE,
    "kv_timeout": StatusCode.DEADLINE_EXCEEDED,
}
_BY_HTTP = {
    400: StatusCode.INVALID_ARGUMENT, 401: StatusCode.UNAUTHENTICATED,
    404: StatusCode.NOT_FOUND, 413: StatusCode.INVALID_ARGUMENT, 429: StatusCode.RESOURCE_EXHAUSTED,
    499: StatusCode.CANCELLED, 502: StatusCode.UNAVAILABLE, 503: StatusCode.UNAVAILABLE,
    504: StatusCode.DEADLINE_EXCEEDED,
}


def code_for_reason(reason: str, http_status: int) -> StatusCode:
    """The code of a request that ended early with `reason` (HTTP status `http_status`)."""
    return _BY_REASON.get(reason) or _BY_HTTP.get(http_status, StatusCode.INTERNAL)


def code_for_error(exc: BaseException) -> StatusCode:
    """The code of an error raised before a request ran (INTERNAL for anything unexpected)."""
    if isinstance(exc, ClientError):
        reason = getattr(exc, "reason", "bad_request")
        return code_for_reason(reason if reason != "bad_request" else "", exc.status)
    if isinstance(exc, QueueFull):
        return StatusCode.RESOURCE_EXHAUSTED
    if isinstance(exc, ServiceUnavailable):
        return StatusCode.UNAVAILABLE
    if isinstance(exc, AdmissionRejected):
        return StatusCode.INVALID_ARGUMENT
    if isinstance(exc, RejectedAtStart):
        return code_for_reason(exc.code, exc.status)
    return StatusCode.INTERNAL
