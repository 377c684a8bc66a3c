"""The errors region agents raise and the gRPC status each becomes.

Agents raise `RegionError`s (and let engine / transport errors through); `unary` and
`streaming` wrap a servicer method so every exception leaves as a gRPC status with a
stable message, never as a crash or a hung call.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator
from typing import Any, NoReturn, TypeVar

import grpc

from prfaas.engine.errors import (
    EngineError,
    EngineUnavailable,
    InvalidPrompt,
    InvalidSamplingParams,
    KVIncompatible,
    WorkerTimeout,
)
from prfaas.transport.errors import PeerUnavailable, TicketRejected, TransferCanceled, TransferTimeout, TransportError

log = logging.getLogger(__name__)
Req = TypeVar("Req")
Rep = TypeVar("Rep")


class RegionError(Exception):
    """Base of the errors region agents raise; `code` is the gRPC status the caller gets.

    A subclass names its status in its bases: `class Exhausted(RegionError, code=...)`; one
    that names none keeps its parent's."""

    code = grpc.StatusCode.INTERNAL

    def __init_subclass__(cls, *, code: grpc.StatusCode | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if code is not None:
            cls.code = code


class InvalidRequest(RegionError, code=grpc.StatusCode.INVALID_ARGUMENT):
    """The request itself is wrong (a field out of range, a malformed id): sending it again
    anywhere gets the same answer."""


class Exhausted(RegionError, code=grpc.StatusCode.RESOURCE_EXHAUSTED):
    """Queue or KV buffer full: retry elsewhere or later."""


class NotFound(RegionError, code=grpc.StatusCode.NOT_FOUND):
    """No reservation, lease or job of that id here (expired, released, or never made)."""


class Conflict(RegionError, code=grpc.StatusCode.ALREADY_EXISTS):
    """The job (or this attempt of it) already runs or holds a reservation here."""


class Unavailable(RegionError, code=grpc.StatusCode.UNAVAILABLE):
    """A peer region is gone, or this region is draining."""


class DeadlineExceeded(RegionError, code=grpc.StatusCode.DEADLINE_EXCEEDED):
    """The job's deadline passed here (KV not arrived, decode not done): the caller retries or fails it."""


class Canceled(RegionError, code=grpc.StatusCode.CANCELLED):
    """The job was canceled while this call served it."""


class PreconditionFailed(RegionError, code=grpc.StatusCode.FAILED_PRECONDITION):
    """The request is well formed but does not fit what this region holds (another attempt's
    reservation, KV of another shape or dtype)."""


class PermissionDenied(RegionError, code=grpc.StatusCode.PERMISSION_DENIED):
    """A ticket names another tenant, or a shipment exceeds what its ticket allows."""


# Engine and transport errors reaching a servicer: (type, status, message prefix), the first
# match wins, so a subclass stands before its base.
_FOREIGN: tuple[tuple[type[Exception], grpc.StatusCode, str], ...] = (
    (InvalidPrompt, grpc.StatusCode.INVALID_ARGUMENT, ""),
    (InvalidSamplingParams, grpc.StatusCode.INVALID_ARGUMENT, ""),
    (KVIncompatible, grpc.StatusCode.FAILED_PRECONDITION, ""),
    (EngineUnavailable, grpc.StatusCode.UNAVAILABLE, "engine unavailable: "),
    (WorkerTimeout, grpc.StatusCode.DEADLINE_EXCEEDED, "engine deadline: "),
    (EngineError, grpc.StatusCode.INTERNAL, "engine error: "),
    (TicketRejected, grpc.StatusCode.PERMISSION_DENIED, "transfer ticket rejected: "),
    (PeerUnavailable, grpc.StatusCode.UNAVAILABLE, "KV peer unavailable: "),
    (TransferTimeout, grpc.StatusCode.DEADLINE_EXCEEDED, "KV transfer deadline: "),
    (TransferCanceled, grpc.StatusCode.CANCELLED, "KV transfer canceled: "),
    (TransportError, grpc.StatusCode.DATA_LOSS, "KV transfer failed: "),
)


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status and message a caller gets for `exc`."""
    if isinstance(exc, RegionError):
        return exc.code, str(exc)
    for kind, code, prefix in _FOREIGN:
        if isinstance(exc, kind):
            return code, f"{prefix}{exc}"
    return grpc.StatusCode.INTERNAL, "internal error (logged by the region)"


def _abort(context: grpc.ServicerContext, exc: BaseException, name: str) -> NoReturn:
    code, message = status_of(exc)
    if code is grpc.StatusCode.INTERNAL:
        log.error("%s failed", name, exc_info=exc)
    context.abort(code, message)
    raise AssertionError("unreachable")  # abort raises


def unary(method: Callable[[Any, Req, grpc.ServicerContext], Rep]) -> Callable[[Any, Req, grpc.ServicerContext], Rep]:
    @functools.wraps(method)
    def wrapper(self: Any, request: Req, context: grpc.ServicerContext) -> Rep:
        try:
            return method(self, request, context)
        except Exception as exc:
            _abort(context, exc, method.__name__)

    return wrapper


def streaming(
    method: Callable[[Any, Req, grpc.ServicerContext], Iterator[Rep]],
) -> Callable[[Any, Req, grpc.ServicerContext], Iterator[Rep]]:
    @functools.wraps(method)
    def wrapper(self: Any, request: Req, context: grpc.ServicerContext) -> Iterator[Rep]:
        try:
            yield from method(self, request, context)
        except Exception as exc:
            _abort(context, exc, method.__name__)

    return wrapper
