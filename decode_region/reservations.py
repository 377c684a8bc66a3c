"""A reservation of KV buffer bytes for one job attempt, from Reserve until it ends, and the
tombstone its outcome leaves (so a caller arriving after a failure gets the failure's status,
not NOT_FOUND).

A reservation ends exactly once (`DecodeAgent._end`), whatever ends it: Decode finished,
Release, Cancel, the caller gone, its deadline, the prefill region lost, a bad shipment.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NoReturn

import grpc

from prfaas.decode_region.backend import Expected, KVHold
from prfaas.decode_region.peer_watch import Watch
from prfaas.region.errors import Canceled, RegionError, status_of
from prfaas.telemetry import tracing


@dataclass(eq=False)
class Reservation:
    job_id: str
    attempt: int
    tenant: str
    kv_bytes: int
    deadline: float  # monotonic
    created: float = field(default_factory=time.monotonic)
    created_ns: int = field(default_factory=time.time_ns)  # the same instant, on the clock spans are in
    trace: str = ""  # the Reserve call's trace context: the KV receive span's parent when the OPEN brings none
    decoding: bool = False  # a Decode claimed it
    ended: bool = False
    error: BaseException | None = None
    canceled: threading.Event = field(default_factory=threading.Event)
    cond: threading.Condition = field(default_factory=threading.Condition)
    watch: Watch | None = None  # on the prefill region that owes the KV
    hold: KVHold | None = None  # the backend's hold on the shipment

    def expected(self, cache_salt: str | None = None, token_ids: tuple[int, ...] = ()) -> Expected:
        return Expected(self.job_id, self.attempt, self.tenant, self.kv_bytes, self.deadline, self.created,
                        cache_salt, token_ids)  # fmt: skip

    def raise_ended(self) -> NoReturn:
        raise_as_region_error(self.error or Canceled("reservation ended"))


@dataclass(frozen=True)
class Tombstone:
    attempt: int
    error: BaseException | None
    at: float  # monotonic


class CarriedStatus(RegionError):
    """A status carried over from a non-region error (transport, engine)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def raise_as_region_error(error: BaseException) -> NoReturn:
    """Raise `error` again, as a RegionError with the status it maps to if it is not one."""
    if isinstance(error, RegionError):
        raise error
    code, message = status_of(error)
    raise CarriedStatus(code, message)


class ReservationEvents:
    """A reservation's `ShipmentEvents`: what its backend reports about the shipment; `end` ends the
    reservation (the agent's)."""

    def __init__(self, res: Reservation, end: Callable[[Reservation, BaseException], None]) -> None:
        self.res = res
        self.end = end

    def arrived(self, trace: str = "") -> None:
        res = self.res
        if res.watch is not None:
            res.watch.stop()  # the prefill region owes us nothing more
        tracing.span_at("decode.kv_receive", tracing.from_traceparent(trace or res.trace), res.created_ns,
                        time.time_ns(), {tracing.JOB_ID: res.job_id, "prfaas.kv_bytes": res.kv_bytes})  # fmt: skip

    def failed(self, error: BaseException) -> None:
        self.end(self.res, error)
