"""What a decode region holds: its reservations (KV buffer bytes booked in `KVBook` for a
job attempt), the tombstones ended ones leave, and its local (Generate) jobs, with the one
lock over them, the `max_jobs` admission and the end of a reservation.

A reservation ends exactly once (`end`), whatever ends it (Decode finished, Release, Cancel,
client disconnect, deadline, the prefill region lost, a bad shipment); its bytes are freed
right then and the backend's hold on its shipment ended. Its outcome stays readable for
`TOMBSTONE_S` (`Tombstone`), so a caller arriving after a failure gets the failure's status,
not NOT_FOUND: the status alone, not the error, whose traceback would keep the KV its frames
held alive as long.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Container

from prfaas.decode_region import metrics
from prfaas.decode_region.book import KVBook
from prfaas.decode_region.local_jobs import LocalJob
from prfaas.decode_region.reservations import Reservation, Tombstone
from prfaas.region.errors import Conflict, DeadlineExceeded, Exhausted, Unavailable

log = logging.getLogger(__name__)
TOMBSTONE_S = 120.0


class HeldJobs:
    def __init__(self, book: KVBook, max_jobs: int) -> None:
        """`max_jobs`: reservations and local jobs held at once; past it `add` is RESOURCE_EXHAUSTED."""
        self.book = book
        self.max_jobs = max_jobs
        self.lock = threading.Lock()
        self.reservations: dict[str, Reservation] = {}
        self.tombstones: dict[str, Tombstone] = {}
        self.local: dict[str, LocalJob] = {}  # Generate jobs, by job id
        self.closed = threading.Event()  # set by `close`: nothing is admitted after it

    def _admit(self, job_id: str, conflict: str, *holders: Container[str]) -> None:
        """Room for one more job (under the lock): Unavailable once closed, Conflict (`conflict`) if
        `job_id` is in one of `holders`, Exhausted past `max_jobs`."""
        if self.closed.is_set():  # close() took its lists already: this one would stay (or run on)
            raise Unavailable("decode region shutting down")
        if any(job_id in held for held in holders):
            raise Conflict(conflict)
        if len(self.reservations) + len(self.local) >= self.max_jobs:
            raise Exhausted(f"decode region holds {self.max_jobs} jobs (max_jobs); place the job elsewhere")

    def reserve(self, res: Reservation) -> int:
        """Book `res`'s bytes and hold it; the bytes left free. BufferFull (RESOURCE_EXHAUSTED) past them."""
        with self.lock:
            self._admit(res.job_id, f"job {res.job_id} already holds a reservation", self.reservations)
            free = self.book.reserve(res.job_id, res.kv_bytes)
            self.reservations[res.job_id] = res
            self.tombstones.pop(res.job_id, None)
        return free

    def add_local(self, job_id: str, job: LocalJob) -> None:
        with self.lock:
            self._admit(job_id, f"job {job_id} is already running here", self.local, self.reservations)
            self.local[job_id] = job

    def drop_local(self, job_id: str) -> None:
        with self.lock:
            self.local.pop(job_id, None)

    def reservation(self, job_id: str) -> Reservation | None:
        with self.lock:
            return self.reservations.get(job_id)

    def found(self, job_id: str) -> tuple[Reservation | None, Tombstone | None, LocalJob | None]:
        with self.lock:
            return self.reservations.get(job_id), self.tombstones.get(job_id), self.local.get(job_id)

    def end(self, res: Reservation, error: BaseException | None) -> bool:
        """End `res` once: free its bytes, stop its shipment, its watch and its decode; False if it had
        ended. Of `error` only its status is kept (`CarriedStatus`), not the frames its traceback holds."""
        if not res.mark_ended(error):
            return False
        status = res.error
        with self.lock:
            if self.reservations.get(res.job_id) is res:
                del self.reservations[res.job_id]
                self.book.release(res.job_id)
            self.tombstones[res.job_id] = Tombstone(res.attempt, status, time.monotonic())
        if res.watch is not None:
            res.watch.stop()
        if res.hold is not None:
            res.hold.end(f"reservation ended: {status}" if status is not None else "reservation ended")
        outcome = "done"
        if status is not None:
            log.info("reservation %s attempt %d ended: %s %s", res.job_id, res.attempt, status.code.name, status)
            outcome = status.code.name.lower()
        metrics.RESERVATIONS_ENDED.labels(outcome).inc()
        gauges(self.book)
        return True

    def reap(self) -> None:
        """End the reservations past their deadline that no Decode claimed; forget old tombstones."""
        now = time.monotonic()
        with self.lock:
            due = [r for r in self.reservations.values() if now >= r.deadline and not r.decoding]
            for job_id in [j for j, t in self.tombstones.items() if now - t.at > TOMBSTONE_S]:
                del self.tombstones[job_id]
        for res in due:
            self.end(res, DeadlineExceeded("reservation expired before its KV was decoded"))

    def empty(self) -> bool:
        with self.lock:
            return not self.reservations and not self.local

    def close(self) -> tuple[list[Reservation], list[LocalJob]]:
        """Admit nothing more; what was held, for the caller to end."""
        self.closed.set()
        with self.lock:
            return list(self.reservations.values()), list(self.local.values())

    def end_all(self, reservations: list[Reservation], local: list[LocalJob]) -> None:
        for res in reservations:
            self.end(res, Unavailable("decode region shutting down"))
        for job in local:
            job.stop(Unavailable("decode region shutting down"))


def gauges(book: KVBook) -> None:
    used = book.used_bytes
    metrics.KV_USED.set(used)
    metrics.KV_FREE.set(book.capacity_bytes - used)
    metrics.RESERVATIONS.set(book.num_reservations)
