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
    """Base of the errors region agents raise; `code` is the gRPC status the caller gets."""

    code = grpc.StatusCode.INTERNAL


class InvalidRequest(RegionError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class Exhausted(RegionError):
    """Queue or KV buffer full: retry elsewhere or later."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class NotFound(RegionError):
    code = grpc.StatusCode.NOT_FOUND


class Conflict(RegionError):
    code = grpc.StatusCode.ALREADY_EXISTS


class Unavailable(RegionError):
    """A peer region is gone, or this region is draining."""

    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(RegionError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Canceled(RegionError):
    code = grpc.StatusCode.CANCELLED


class PreconditionFailed(RegionError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class PermissionDenied(RegionError):
    code = grpc.StatusCode.PERMISSION_DENIED


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status and message a caller gets for `exc`."""
    if isinstance(exc, RegionError):
        return exc.code, str(exc)
    if isinstance(exc, (InvalidPrompt, InvalidSamplingParams)):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, KVIncompatible):
        return grpc.StatusCode.FAILED_PRECONDITION, str(exc)
    if isinstance(exc, EngineUnavailable):
        return grpc.StatusCode.UNAVAILABLE, f"engine unavailable: {exc}"
    if isinstance(exc, WorkerTimeout):
        return grpc.StatusCode.DEADLINE_EXCEEDED, f"engine deadline: {exc}"
    if isinstance(exc, EngineError):
        return grpc.StatusCode.INTERNAL, f"engine error: {exc}"
    if isinstance(exc, TicketRejected):
        return grpc.StatusCode.PERMISSION_DENIED, f"transfer ticket rejected: {exc}"
    if isinstance(exc, PeerUnavailable):
        return grpc.StatusCode.UNAVAILABLE, f"KV peer unavailable: {exc}"
    if isinstance(exc, TransferTimeout):
        return grpc.StatusCode.DEADLINE_EXCEEDED, f"KV transfer deadline: {exc}"
    if isinstance(exc, TransferCanceled):
        return grpc.StatusCode.CANCELLED, f"KV transfer canceled: {exc}"
    if isinstance(exc, TransportError):
        return grpc.StatusCode.DATA_LOSS, f"KV transfer failed: {exc}"
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
