"""The decode region's engine workers: a fixed number of slots, each waited for no longer
than the call's deadline. Counts what is busy and waiting for the region's load."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

from prfaas.decode_region import metrics
from prfaas.region.errors import Canceled, DeadlineExceeded

WAIT_STEP_S = 0.05  # how soon a job waiting for a worker notices its cancel


class WorkerSlots:
    def __init__(self, num_workers: int) -> None:
        self.num_workers = num_workers
        self._slots = threading.BoundedSemaphore(num_workers)
        self._lock = threading.Lock()
        self.busy = 0
        self.waiting = 0
        self.mean_hold_s = 0.0  # smoothed seconds a slot is held per job (the region's queue wait per job ahead)

    @contextlib.contextmanager
    def slot(self, deadline: float, canceled: threading.Event | None = None) -> Iterator[None]:
        """One worker, held for the block; DeadlineExceeded if none frees up by `deadline`, Canceled as soon as
        `canceled` is set while it waits (a job canceled in the queue leaves it then, not when a worker frees)."""
        with self._lock:
            self.waiting += 1
        try:
            while not self._slots.acquire(timeout=min(WAIT_STEP_S, max(0.0, deadline - time.monotonic()))):
                if canceled is not None and canceled.is_set():
                    raise Canceled("canceled while waiting for a decode worker")
                if time.monotonic() >= deadline:
                    raise DeadlineExceeded(f"all {self.num_workers} decode workers stayed busy until the deadline")
        finally:
            with self._lock:
                self.waiting -= 1
        with self._lock:
            self.busy += 1
            metrics.BUSY_WORKERS.set(self.busy)
        taken = time.monotonic()
        try:
            yield
        finally:
            held = time.monotonic() - taken
            with self._lock:
                self.mean_hold_s = held if self.mean_hold_s == 0 else 0.8 * self.mean_hold_s + 0.2 * held
                self.busy -= 1
                metrics.BUSY_WORKERS.set(self.busy)
            self._slots.release()
