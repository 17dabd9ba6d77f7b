"""The error hierarchy. Anything a client, a peer or an operator can cause is one of these.

Per-request errors fail that request only (its pages are returned); `FatalError` means the
process must exit so that its supervisor restarts it.
"""

from __future__ import annotations


class DecodeWorkerError(Exception):
    """Base of every error this package raises on purpose."""


class ConfigError(DecodeWorkerError):
    """Invalid settings or an unsupported model/cache combination, found at startup."""


class ClientError(DecodeWorkerError):
    """A bad request from a client: answered with a 4xx and a message, nothing else changes.
    `reason` is the error body's `reason` (an abort label of docs/CONTRACTS.md, or a more
    specific word such as `model_not_found`)."""

    status = 400
    reason = "bad_request"


class RequestTooLarge(ClientError):
    """The prompt or the requested output can never fit this worker."""

    status = 413
    reason = "too_large"


class ServiceUnavailable(DecodeWorkerError):
    """The worker cannot take the request now: retry later (503 with Retry-After)."""

    reason = "unavailable"


class QueueFull(ServiceUnavailable):
    """`scheduler.max_queued_requests` requests already wait (not yet running): retry later or
    elsewhere (HTTP 503, gRPC RESOURCE_EXHAUSTED), unlike a worker that takes no work at all."""

    reason = "queue_full"


class Draining(ServiceUnavailable):
    """The worker is draining (SIGTERM): it finishes what it has and takes nothing new."""

    reason = "drain"


class OutOfPages(DecodeWorkerError):
    """A page allocator has fewer free pages than asked for."""


class PageError(DecodeWorkerError):
    """A page id that is out of range, or a free of a page that is not held."""


class InvalidTransition(DecodeWorkerError):
    """A request state machine was asked for a transition its state does not allow."""


class AdmissionRejected(DecodeWorkerError):
    """A request that can never be admitted (larger than a pool, SWA reclaim insufficient)."""


class TransferError(DecodeWorkerError):
    """A KV transfer failed: peer gone, peer-reported error, timeout or bad page ids."""


class ProtocolError(TransferError):
    """A peer sent a message we cannot decode or that breaks the protocol."""


class IncompatiblePeer(TransferError):
    """The handshake found that the two sides disagree on model, dtype, layout or version."""


class FatalError(DecodeWorkerError):
    """A broken invariant or a device failure: the process exits non-zero."""


class LockStateError(FatalError):
    """A radix-tree lock released twice, or a lock count that would go negative."""
