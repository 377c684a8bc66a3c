"""Placement at admission: the API process asks the scheduler itself, and a job that runs
locally in its decode region is written already handed off (state LOCAL, its hand-off
posted, in the same Redis step that admits it) and streamed at once. Only split jobs, which
need a prefill to orchestrate and follow, go through Celery. A local job loses nothing by
it: its tokens always came straight from the decode region to this process, and a failed
local run is retried through Celery as before (`Follower._retry`).

The fleet is read at most every `snapshot_ttl_s` (regions beat every few hundred ms, so a
fresher read would not be fresher in substance), which keeps the scheduler's input off the
request path's Redis round trips."""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping

from prfaas.control_plane.fleet.records import RegionNotFound, RegionRecord
from prfaas.control_plane.jobs.dispatch import job_request, placed_fields, ready_info
from prfaas.control_plane.jobs.states import JobState
from prfaas.control_plane.jobs.store import HandedOff
from prfaas.control_plane.scheduling.decision import Mode
from prfaas.control_plane.scheduling.errors import PlacementRejected
from prfaas.control_plane.scheduling.snapshot import ClusterSnapshot
from prfaas.control_plane.services import Services


class AdmissionPlacer:
    def __init__(self, services: Services, snapshot_ttl_s: float) -> None:
        self.s = services
        self.ttl_s = snapshot_ttl_s
        self._lock = threading.Lock()
        self._read_at = -float("inf")
        self._view: tuple[ClusterSnapshot, dict[str, RegionRecord]] | None = None

    def view(self) -> tuple[ClusterSnapshot, dict[str, RegionRecord]]:
        """The fleet as last read (at most `ttl_s` old) and its records by name."""
        with self._lock:
            if self._view is None or time.monotonic() - self._read_at > self.ttl_s:
                records = self.s.regions.regions()
                snapshot = self.s.regions.snapshot_of(records, self.s.regions.links(), self.s.model.shape)
                self._view = snapshot, {r.name: r for r in records}
                self._read_at = time.monotonic()
            return self._view

    def place(self, job: Mapping[str, str]) -> tuple[HandedOff, dict[str, object]] | None:
        """For a job that runs locally: its hand-off and the fields recording the decision.
        None for anything else (split, or no placement now): Celery decides on a fresh
        snapshot, retries and records a rejection."""
        snapshot, records = self.view()
        try:
            decision = self.s.schedulers[job.get("placement_asked", "auto")].decide(
                snapshot, job_request(job, self.s.settings)
            )
        except PlacementRejected:
            return None
        if decision.mode is not Mode.LOCAL:
            return None
        try:
            decode = records[decision.decode_region].pick()
            prefill = records[decision.prefill_region].pick()
        except RegionNotFound:
            return None  # gone since the view was read: Celery decides on a fresh one
        fields = placed_fields(decision, decode, prefill)
        return HandedOff(JobState.LOCAL, f"local in {decode.key}", ready_info("local", decode)), fields
