"""A reservation of KV buffer bytes for one job attempt, from Reserve until it ends, and the
tombstone its outcome leaves (so a caller arriving after a failure gets the failure's status,
not NOT_FOUND).

A reservation ends exactly once (`HeldJobs.end`, held.py), whatever ends it: Decode finished,
Release, Cancel, the caller gone, its deadline, the prefill region lost, a bad shipment.
"""

from __future__ import annotations

import logging
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

log = logging.getLogger(__name__)


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
    error: CarriedStatus | None = None  # why it ended (None: its Decode finished), as a status alone
    canceled: threading.Event = field(default_factory=threading.Event)
    cond: threading.Condition = field(default_factory=threading.Condition)
    watch: Watch | None = None  # on the prefill region that owes the KV
    hold: KVHold | None = None  # the backend's hold on the shipment

    def expected(self, cache_salt: str | None = None, token_ids: tuple[int, ...] = ()) -> Expected:
        return Expected(self.job_id, self.attempt, self.tenant, self.kv_bytes, self.deadline, self.created,
                        cache_salt, token_ids)  # fmt: skip

    def attach(self, hold: KVHold | None = None, watch: Watch | None = None) -> bool:
        """Attach the shipment's hold or the watch on its sender, for `HeldJobs.end` to stop; False if the
        reservation had ended (`end` found nothing of it): it is stopped here then."""
        with self.cond:
            ended = self.ended
            if not ended and hold is not None:
                self.hold = hold
            if not ended and watch is not None:
                self.watch = watch
        if ended and watch is not None:
            watch.stop()
        if ended and hold is not None:
            hold.end(f"reservation ended: {self.error}")
        return not ended

    def mark_ended(self, error: BaseException | None) -> bool:
        """Mark it ended with `error`'s status (None: its Decode finished) and wake what waits on it; False
        if it had ended. Only the status is kept (`CarriedStatus`), not the frames `error`'s traceback holds."""
        status = CarriedStatus.of(error) if error is not None else None
        with self.cond:
            if self.ended:
                return False
            self.ended, self.error = True, status
            self.canceled.set()
            self.cond.notify_all()
        return True

    def raise_ended(self) -> NoReturn:
        raise_as_region_error(self.error or Canceled("reservation ended"))


@dataclass(frozen=True)
class Tombstone:
    attempt: int
    error: CarriedStatus | None
    at: float  # monotonic


class CarriedStatus(RegionError):
    """An error's status alone (code and message), with no traceback, context or cause. What a
    reservation keeps of why it ended, in its tombstone for minutes: the error itself would keep
    every frame its traceback passed alive, and with them the KV tensors (device memory) or the
    engine's cache those frames held, long after the reservation's bytes were freed."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code

    @classmethod
    def of(cls, error: BaseException) -> CarriedStatus:
        code, message = status_of(error)
        return cls(code, message)


def raise_as_region_error(error: BaseException) -> NoReturn:
    """Raise `error`'s status as a new RegionError. A kept error is never raised itself: raising it
    would tie the raising frames to it again (and threads raising it at once would share one traceback)."""
    raise CarriedStatus.of(error) from None


class ReservationEvents:
    """A reservation's `ShipmentEvents`: what its backend reports about the shipment; `end` ends the
    reservation (the agent's)."""

    def __init__(self, res: Reservation, end: Callable[[Reservation, BaseException], object]) -> None:
        self.res = res
        self.end = end

    def arrived(self, trace: str = "") -> None:
        res = self.res
        if res.watch is not None:
            res.watch.stop()  # the prefill region owes us nothing more
        tracing.span_at("decode.kv_receive", tracing.from_traceparent(trace or res.trace), res.created_ns,
                        time.time_ns(), {tracing.JOB_ID: res.job_id, "prfaas.kv_bytes": res.kv_bytes})  # fmt: skip

    def failed(self, error: BaseException) -> None:
        if status_of(error)[0] is grpc.StatusCode.INTERNAL:  # no call raises it: its traceback is logged here
            log.error("shipment for reservation %s failed", self.res.job_id, exc_info=error)
        self.end(self.res, error)
