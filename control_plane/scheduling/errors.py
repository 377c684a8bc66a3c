"""Typed errors of the global scheduler.

Two families: `PolicyConfigError` (a policy file or plugin parameters that cannot be used:
raised when a scheduler is built, never while deciding) and `PlacementRejected` (a valid
request that no placement can serve: raised by `GlobalScheduler.decide`). The HTTP layer maps
the first to a startup failure and the second to a 4xx/503 with the stable `reason` value.
"""

from __future__ import annotations

from enum import StrEnum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from prfaas.control_plane.scheduling.decision import Explanation


class SchedulerError(Exception):
    """Base class of every error the scheduler raises."""


class PolicyConfigError(SchedulerError):
    """A policy (YAML or mapping) or a plugin's parameters failed validation.

    `field` is the dotted path of the offending value, e.g.
    `profiles.prefill.filters[0].params.max_heartbeat_age_s`.
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field
        self.message = message


class UnknownPluginType(PolicyConfigError):
    """A policy names a plugin type that no factory is registered for."""


class InvalidSchedulerInput(SchedulerError):
    """A snapshot or request document (JSON) failed validation; `field` names the value."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field
        self.message = message


class RejectReason(StrEnum):
    """Why no placement exists. Stable strings: the API returns them as they are."""

    NO_ELIGIBLE_REGION = "no_eligible_region"  # no region of the needed role in the snapshot
    UNHEALTHY = "unhealthy"  # every candidate missed heartbeats or reported unhealthy
    RESIDENCY = "residency"  # every candidate lies outside the request's allowed regions
    CAPACITY = "capacity"  # no KV buffer room / every prefill queue full
    SLO = "slo"  # no placement is predicted to meet the TTFT / TPOT objective
    LINK_SATURATED = "link_saturated"  # every usable link is above its utilization limit


class PlacementRejected(SchedulerError):
    """No placement can serve the request. `reason` says why; `explanation` holds the trace
    (which filter cut which candidate in every stage that ran)."""

    def __init__(self, reason: RejectReason, message: str, explanation: Explanation) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.explanation = explanation


class NoEligibleRegion(PlacementRejected):
    """The snapshot holds no region that could decode the request."""


class NoHealthyRegion(PlacementRejected):
    """Every candidate region missed heartbeats or reported itself unhealthy."""


class ResidencyUnsatisfiable(PlacementRejected):
    """No region inside the request's allowed regions can serve it."""


class InsufficientCapacity(PlacementRejected):
    """No region has the KV buffer room or prefill queue room the request needs."""


class SloUnattainable(PlacementRejected):
    """No placement is predicted to meet the request's TTFT and TPOT objectives."""


class LinksSaturated(PlacementRejected):
    """Every link a split could use is above its utilization limit, and local is not possible."""


REJECTIONS: dict[RejectReason, type[PlacementRejected]] = {
    RejectReason.NO_ELIGIBLE_REGION: NoEligibleRegion,
    RejectReason.UNHEALTHY: NoHealthyRegion,
    RejectReason.RESIDENCY: ResidencyUnsatisfiable,
    RejectReason.CAPACITY: InsufficientCapacity,
    RejectReason.SLO: SloUnattainable,
    RejectReason.LINK_SATURATED: LinksSaturated,
}


def rejection(reason: RejectReason, message: str, explanation: Explanation) -> PlacementRejected:
    """The typed rejection for `reason` (a subclass of `PlacementRejected`)."""
    return REJECTIONS[reason](reason, message, explanation)
