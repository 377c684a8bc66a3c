"""What both region agents share on the gRPC side: typed errors and their status codes,
proto <-> engine conversions, server and channel options.

Agents raise `RegionError`s (and let engine / transport errors through); `unary` and
`streaming` wrap a servicer method so every exception leaves as a gRPC status with a
stable message, never as a crash or a hung call.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import uuid
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
from prfaas.engine.sampling import SamplingParams
from prfaas.protos.prfaas.v1 import common_pb2
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


def job_uuid(value: str) -> str:
    """The canonical form of a job id; InvalidRequest unless it is a UUID."""
    try:
        return str(uuid.UUID(value))
    except ValueError:
        raise InvalidRequest(f"job_id must be a UUID, got {value[:64]!r}") from None


def timeout_from(value: float, *, default_s: float, max_s: float, field: str = "timeout_s") -> float:
    """A request's timeout: 0 (unset) means `default_s`; it must be > 0 and at most `max_s`."""
    if value == 0:
        return default_s
    if not 0 < value <= max_s:  # also rejects NaN
        raise InvalidRequest(f"{field} must be in (0, {max_s:g}] seconds, got {value}")
    return value


def sampling_from_proto(msg: common_pb2.SamplingParams) -> SamplingParams:
    return SamplingParams(
        max_new_tokens=msg.max_new_tokens,
        temperature=msg.temperature,
        top_p=msg.top_p or 1.0,
        seed=msg.seed if msg.HasField("seed") else None,
        ignore_eos=msg.ignore_eos,
    )


def sampling_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(
        max_new_tokens=params.max_new_tokens, temperature=params.temperature, top_p=params.top_p,
        ignore_eos=params.ignore_eos,
    )  # fmt: skip
    if params.seed is not None:
        msg.seed = params.seed
    return msg


CONNECT_TIMEOUT_FLOOR_MS = 2000  # a loaded host's loopback handshake must never count as a dead peer


def replies(call: Any, grace_s: float = 5.0) -> Iterator[Any]:
    """A server-streaming call's replies, read on a thread of their own, so that the caller
    never waits in `next()` past the call's end: the iterator of a call that has ended can
    wait forever (grpc/grpc#20562; seen here 1-4 times in 500 stops of a region while a
    call to it connects: the call ended UNAVAILABLE and `next()` never returned). When the
    call has ended and its reader is still stuck `grace_s` later, the replies end there.
    Raises the call (a `grpc.RpcError`) if it ended with a status other than OK; closing the
    generator early cancels the call. The call's own deadline bounds the wait."""
    inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
    call.add_done_callback(lambda _call: inbox.put(("done", None)))  # on gRPC's thread: only signal

    def read() -> None:
        try:
            for reply in call:
                inbox.put(("reply", reply))
        except grpc.RpcError:
            pass
        inbox.put(("end", None))

    threading.Thread(target=read, name="prfaas-rpc-read", daemon=True).start()
    done = False
    try:
        while True:
            try:
                kind, reply = inbox.get(timeout=grace_s if done else None)
            except queue.Empty:
                log.warning("a stream's reader is stuck %.0f s after its call ended (grpc#20562)", grace_s)
                break
            if kind == "reply":
                yield reply
            elif kind == "done":
                done = True
            else:
                break
    finally:
        call.cancel()  # no-op once it ended
    if call.code() != grpc.StatusCode.OK:
        raise call


def keepalive_options(interval_s: float) -> list[tuple[str, int]]:
    """Client channel options: a peer that vanishes without closing its connection (power
    loss, partition) is noticed within about two intervals; one that takes the TCP connection
    but never answers the HTTP/2 handshake (hung, or stopping) fails a call's connect in
    max(2 s, two intervals) instead of gRPC's default 20 s."""
    interval_ms = max(100, int(interval_s * 1000))
    return [
        ("grpc.min_reconnect_backoff_ms", max(CONNECT_TIMEOUT_FLOOR_MS, 2 * interval_ms)),  # the connect timeout
        ("grpc.keepalive_time_ms", interval_ms),
        ("grpc.keepalive_timeout_ms", interval_ms),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]


SERVER_OPTIONS: list[tuple[str, int]] = [
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 100),
    ("grpc.http2.max_ping_strikes", 0),
    ("grpc.max_receive_message_length", 64 << 20),  # a 1M-token prompt is 5 MB of token ids
]
