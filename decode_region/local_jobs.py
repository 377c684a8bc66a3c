"""A local (Generate) job as the decode agent holds it while it runs: its attempt, its cancel,
and why it was stopped. A job stopped by a Cancel or by the region shutting down ends with
that status (UNAVAILABLE on shutdown: what the control plane marks a region suspect on, as
for a split Decode), not with the CANCELLED the stop leaves inside the engine's loop."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from prfaas.decode_region.reservations import CarriedStatus


@dataclass(eq=False)
class LocalJob:
    attempt: int
    canceled: threading.Event = field(default_factory=threading.Event)
    reason: CarriedStatus | None = None  # why it was stopped; None while it runs, or when its caller left

    def stop(self, reason: BaseException | None = None) -> None:
        """Cancel the job; `reason` (the first given) is the status its stream ends with. Without
        one (the caller left) the stream ends as the stop makes it end."""
        if reason is not None and self.reason is None:
            self.reason = CarriedStatus.of(reason)  # set before the event: the job reads it once stopped
        self.canceled.set()
