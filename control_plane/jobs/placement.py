"""Placement at admission: the API process asks the scheduler itself, and a job that runs
locally in its decode region is written already handed off (state LOCAL, its hand-off
posted, in the same Redis step that admits it) and streamed at once. Only split jobs, which
need a prefill to orchestrate and follow, go through Celery. A local job loses nothing by
it: its tokens always came straight from the decode region to this process, and a failed
local run is retried through Celery as before (`Follower._retry`).

Every job also gets its predicted $ here, what admission reserves of the tenant's budget
(jobs/store.py): the scheduler's prediction for the placement it chose, or the colocated run's
when that costs more (a split job retried runs locally); with no placement now, the dearest
local run the fleet offers (`predicted_usd`).

The fleet is read at most every `snapshot_ttl_s` (regions beat every few hundred ms, so a
fresher read would not be fresher in substance), which keeps the scheduler's input off the
request path's Redis round trips."""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from prfaas.control_plane.fleet.records import InstanceRecord, RegionNotFound, RegionRecord
from prfaas.control_plane.jobs.records import job_request, placed_fields, ready_info
from prfaas.control_plane.jobs.states import JobState
from prfaas.control_plane.jobs.store import HandedOff
from prfaas.control_plane.scheduling.costmodel import CostModel
from prfaas.control_plane.scheduling.decision import Decision, Mode
from prfaas.control_plane.scheduling.errors import PlacementRejected
from prfaas.control_plane.scheduling.request import Request
from prfaas.control_plane.scheduling.snapshot import ClusterSnapshot, ModelShape
from prfaas.control_plane.services import Services


@dataclass(frozen=True)
class Placed:
    """What admission learned from the scheduler: the job's predicted $ and, for a job it runs locally
    (and `hand_off` asked), its hand-off and the fields recording the decision."""

    predicted_usd: float
    handed_off: HandedOff | None = None
    fields: dict[str, object] = field(default_factory=dict)


def decode_instance(
    region: RegionRecord,
    shape: ModelShape,
    prompt_tokens: int,
    exclude: frozenset[str] = frozenset(),
    prefix: tuple[str, ...] = (),
) -> InstanceRecord:
    """The decode region's instance a job's reservation goes to: one whose free KV buffer holds it (the prompt's
    KV in the region's dtype, what Reserve asks for), then as `RegionRecord.pick` ranks them."""
    return region.pick(exclude, prefix, prompt_tokens * shape.kv_bytes_at(region.kv_dtype))


def predicted_usd(decision: Decision | None, snapshot: ClusterSnapshot, request: Request, costs: CostModel) -> float:
    """$ to reserve for `request` (pure): the decision's predicted cost, or its colocated alternative's when
    dearer (a retry may run it locally); without a decision, the dearest local run among the regions that
    decode (0 with none: the job cannot run)."""
    if decision is not None:
        return max(decision.cost.total_usd, decision.colocated_cost.total_usd)
    local = [costs.local(request, r, request.prompt_tokens).total_usd for r in snapshot.regions if r.can_decode]
    return max(local, default=0.0)


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

    def place(self, job: Mapping[str, str], hand_off: bool = True) -> Placed:
        """The job's predicted $ and, for a job that runs locally (when `hand_off`), its hand-off and the
        fields recording the decision. Split jobs and rejected placements are left to Celery, which decides
        on a fresh snapshot, retries and records a rejection."""
        snapshot, records = self.view()
        scheduler = self.s.schedulers[job.get("placement_asked", "auto")]
        request = job_request(job, self.s.settings)
        started = time.perf_counter()
        try:
            decision: Decision | None = scheduler.decide(snapshot, request)
        except PlacementRejected:
            decision = None
        placement_s = time.perf_counter() - started
        usd = predicted_usd(decision, snapshot, request, scheduler.cost_model)
        if decision is None or decision.mode is not Mode.LOCAL or not hand_off:
            return Placed(usd)
        try:
            decode = decode_instance(records[decision.decode_region], self.s.model.shape, request.prompt_tokens,
                                     prefix=request.prefix_block_hashes)  # fmt: skip
            prefill = records[decision.prefill_region].pick(prefix=request.prefix_block_hashes)
        except RegionNotFound:
            return Placed(usd)  # gone since the view was read: Celery decides on a fresh one
        fields = placed_fields(decision, decode, prefill) | {"regions_a1": f"{prefill.name}>{decode.name}"}  # metering
        fields["placement_s"] = placement_s
        return Placed(usd, HandedOff(JobState.LOCAL, f"local in {decode.key}", ready_info("local", decode)), fields)
