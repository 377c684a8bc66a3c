"""KV buffer accounting: reservations in bytes against a fixed capacity. Pure; thread-safe.

Admission is by bytes only: a reservation either fits in what is free now or is refused
(`BufferFull`, which the agent maps to RESOURCE_EXHAUSTED) so the control plane can place
the job elsewhere at once instead of queueing it here.
"""

from __future__ import annotations

import threading

from prfaas.region.errors import Exhausted


class BufferFull(Exhausted):
    """The KV buffer cannot hold the reservation."""


class KVBook:
    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be > 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._lock = threading.Lock()
        self._held: dict[str, int] = {}  # job id -> bytes

    def reserve(self, job_id: str, nbytes: int) -> int:
        """Hold `nbytes` for `job_id`; returns the bytes left free. Raises BufferFull."""
        with self._lock:
            if job_id in self._held:
                raise ValueError(f"job {job_id} already holds a reservation")
            used = sum(self._held.values())
            if used + nbytes > self.capacity_bytes:
                raise BufferFull(
                    f"KV buffer full: job needs {nbytes} bytes, {self.capacity_bytes - used} of "
                    f"{self.capacity_bytes} are free"
                )
            self._held[job_id] = nbytes
            return self.capacity_bytes - used - nbytes

    def release(self, job_id: str) -> int:
        """Free what `job_id` holds (idempotent); returns the bytes freed."""
        with self._lock:
            return self._held.pop(job_id, 0)

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return sum(self._held.values())

    @property
    def free_bytes(self) -> int:
        return self.capacity_bytes - self.used_bytes

    @property
    def num_reservations(self) -> int:
        with self._lock:
            return len(self._held)
