"""Built-in filters. Each class is its own parameter model: the registry's factory validates
the YAML `params` mapping against it (unknown keys and bad values are errors naming the field).
Formulas and YAML: docs/scheduler.md, "Plugins"."""

from __future__ import annotations

from typing import ClassVar

from pydantic import BaseModel, ConfigDict, Field

from prfaas.control_plane.scheduling.errors import RejectReason
from prfaas.control_plane.scheduling.plugins import Candidate, Context, Stage


class _Plugin(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class HealthFilter(_Plugin):
    """`health`: cut regions that report unhealthy or whose last heartbeat is older than
    `max_heartbeat_age_s` (default 15 s: three missed 5 s heartbeats) or, for a region that says
    how often it beats, `max_missed_heartbeats` of its intervals when that is longer: a region may
    beat every 60 s, and the registry counts it alive for its missed beats, not a fixed age (a
    fixed 15 s cut it between beats)."""

    reason: ClassVar[RejectReason] = RejectReason.UNHEALTHY
    max_heartbeat_age_s: float = Field(default=15.0, gt=0, allow_inf_nan=False)
    max_missed_heartbeats: float = Field(default=3.0, gt=0, allow_inf_nan=False)  # the registry's default

    def keep(self, ctx: Context, candidate: Candidate) -> bool:
        region = candidate.region
        limit_s = self.max_heartbeat_age_s
        if region.heartbeat_interval_s is not None:
            limit_s = max(limit_s, self.max_missed_heartbeats * region.heartbeat_interval_s)
        return region.healthy and region.heartbeat_age_s <= limit_s


class ResidencyFilter(_Plugin):
    """`residency`: cut regions outside the request's `allowed_regions`."""

    reason: ClassVar[RejectReason] = RejectReason.RESIDENCY

    def keep(self, ctx: Context, candidate: Candidate) -> bool:
        return ctx.request.allows(candidate.region.name)


class CapacityFilter(_Plugin):
    """`capacity`: decode stage, cut regions where no instance's free KV buffer can hold the
    request's KV (prompt plus new tokens: one reservation lands on one instance, so the free
    bytes summed over them overstate it); prefill stage, cut regions whose prefill queue is full."""

    reason: ClassVar[RejectReason] = RejectReason.CAPACITY

    def keep(self, ctx: Context, candidate: Candidate) -> bool:
        if ctx.stage is Stage.DECODE:
            return candidate.region.kv_reservable_bytes >= ctx.kv_bytes_needed(candidate.region)
        return not candidate.region.queue_full


class SloFilter(_Plugin):
    """`slo`: cut placements predicted to miss the SLO. Decode stage: TPOT only (where the
    prefill runs is not chosen yet); prefill stage: TTFT and TPOT. A margin of 0.1 demands the
    prediction be 10% under the objective."""

    reason: ClassVar[RejectReason] = RejectReason.SLO
    ttft_margin: float = Field(default=0.0, ge=0, lt=1)
    tpot_margin: float = Field(default=0.0, ge=0, lt=1)

    def keep(self, ctx: Context, candidate: Candidate) -> bool:
        slo = ctx.request.slo
        if candidate.decode.tpot_ms > slo.tpot_ms * (1.0 - self.tpot_margin):  # TPOT is the decode region's
            return False
        if ctx.stage is Stage.DECODE:
            return True
        limit_s = slo.ttft_ms / 1000.0 * (1.0 - self.ttft_margin)
        return candidate.ttft_floor_s <= limit_s and candidate.estimate.ttft_s <= limit_s


class LinkHeadroomFilter(_Plugin):
    """`link-headroom`: cut split placements whose link is more than `max_utilization` busy
    (default 0.9). Local placements use no link and pass."""

    reason: ClassVar[RejectReason] = RejectReason.LINK_SATURATED
    max_utilization: float = Field(default=0.9, gt=0, le=1)

    def keep(self, ctx: Context, candidate: Candidate) -> bool:
        link = candidate.link
        return link is None or link.utilization <= self.max_utilization
