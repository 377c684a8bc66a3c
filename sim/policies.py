"""The policies a simulation compares: each is a scheduler policy (the same YAML document the
control plane loads) plus which part of the fleet it may use.

- `prfaas`: the default policy (conditional disaggregation over the whole fleet).
- `homogeneous-pd`: never splits, on an equal-GPU homogeneous fleet: the prefill-only regions'
  GPUs become more workers of the PD clusters' own GPU type (split between prefill and decode
  in each cluster's own ratio), the way PrfaaS compares 32 H200 + 64 H20 with 96 H20.
- `homogeneous-pd-equal-cost`: the same at equal $ per hour (on-demand prices) instead of GPUs.
- `naive-heterogeneous`: every request splits to a prefill region (a `split-only` filter cuts
  the local candidate), and the PD clusters decode only (their prefill workers become decode
  workers): heterogeneous PD with all prefill external. Rejected when no split survives the filters.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any, ClassVar

import yaml
from pydantic import BaseModel, ConfigDict, Field

from prfaas.control_plane.scheduling import (
    DEFAULT_POLICY_YAML,
    Candidate,
    Context,
    GlobalScheduler,
    PluginRegistry,
    PolicyConfig,
    RejectReason,
    build_scheduler,
    default_registry,
    policy_from_mapping,
)
from prfaas.sim.fleet import FleetSpec


class SplitOnlyFilter(BaseModel):
    """`split-only`: cut the local candidate in the prefill stage (the naive baseline)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    reason: ClassVar[RejectReason] = RejectReason.NO_ELIGIBLE_REGION

    def keep(self, ctx: Context, candidate: Candidate) -> bool:
        return candidate.link is not None


class SplitAboveFilter(BaseModel):
    """`split-above`: cut the local candidate when the uncached prompt reaches `min_uncached_tokens`
    (a deployment that splits by length alone, as a calibrated bench run did)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    reason: ClassVar[RejectReason] = RejectReason.NO_ELIGIBLE_REGION
    min_uncached_tokens: int = Field(ge=0)

    def keep(self, ctx: Context, candidate: Candidate) -> bool:
        return candidate.link is not None or ctx.uncached(candidate.region) < self.min_uncached_tokens


def sim_registry() -> PluginRegistry:
    """The built-in plugins plus the baselines' `split-only` and `split-above` filters."""
    registry = default_registry()
    registry.register_filter("split-only", lambda params: SplitOnlyFilter.model_validate(dict(params)))
    registry.register_filter("split-above", lambda params: SplitAboveFilter.model_validate(dict(params)))
    return registry


class FleetShape(StrEnum):
    AS_IS = "as-is"
    HOMOGENEOUS = "homogeneous"  # prefill-only regions folded into the PD clusters, equal GPU count
    HOMOGENEOUS_COST = "homogeneous-cost"  # the same, equal $ per hour (more GPUs when the PD type is cheaper)
    DECODE_ONLY_PD = "decode-only-pd"  # the PD clusters' prefill workers turned into decode workers


def homogeneous_fleet(fleet: FleetSpec, *, equal_cost: bool = False) -> FleetSpec:
    """The same number of GPUs (or, `equal_cost`, the same $ per hour at on-demand prices), all
    in the PD clusters and of their GPU type: each PD cluster takes a share of the prefill-only
    regions' GPUs (or their cost) proportional to its own GPU count, as whole workers split
    between prefill and decode in its own ratio (rounded, at least one each)."""
    pd = [r for r in fleet.regions if r.num_decode_workers]
    if not pd:
        raise ValueError("the fleet has no PD cluster to fold its prefill regions into")
    prefill_only = [r for r in fleet.regions if not r.num_decode_workers]
    extra_gpus = sum(r.num_gpus for r in prefill_only)
    extra_usd = sum(r.num_gpus * r.price for r in prefill_only)
    pd_gpus = sum(r.num_gpus for r in pd)
    regions = []
    for region in pd:
        workers = region.num_prefill_workers + region.num_decode_workers
        gpus = extra_usd / region.price if equal_cost and region.price > 0 else extra_gpus
        added = round(gpus * region.num_gpus / pd_gpus / region.gpus_per_worker)
        total = workers + added
        prefill = min(total - 1, max(1, round(total * region.num_prefill_workers / workers)))
        regions.append(replace(region, num_prefill_workers=prefill, num_decode_workers=total - prefill))
    return replace(fleet, regions=tuple(regions), links=())


def decode_only_pd_fleet(fleet: FleetSpec) -> FleetSpec:
    regions = tuple(
        replace(r, num_prefill_workers=0, num_decode_workers=r.num_prefill_workers + r.num_decode_workers)
        if r.num_decode_workers
        else r
        for r in fleet.regions
    )
    return replace(fleet, regions=regions)


@dataclass(frozen=True)
class SimPolicy:
    name: str
    config: PolicyConfig
    shape: FleetShape = FleetShape.AS_IS
    prefix_aware: bool = True  # False: as if no region had a prefix cache (sim/simulator.py)

    def scheduler(self) -> GlobalScheduler:
        return build_scheduler(self.config, sim_registry())

    def fleet_for(self, fleet: FleetSpec) -> FleetSpec:
        if self.shape is FleetShape.HOMOGENEOUS:
            return homogeneous_fleet(fleet)
        if self.shape is FleetShape.HOMOGENEOUS_COST:
            return homogeneous_fleet(fleet, equal_cost=True)
        if self.shape is FleetShape.DECODE_ONLY_PD:
            return decode_only_pd_fleet(fleet)
        return fleet


def _default_document() -> dict[str, Any]:
    document: dict[str, Any] = yaml.safe_load(DEFAULT_POLICY_YAML)
    return document


def _with(document: Mapping[str, Any], **disaggregation: Any) -> dict[str, Any]:
    out = copy.deepcopy(dict(document))
    out["disaggregation"] = {**out.get("disaggregation", {}), **disaggregation}
    return out


def prfaas_policy(document: Mapping[str, Any] | None = None) -> SimPolicy:
    return SimPolicy("prfaas", policy_from_mapping(document or _default_document()))


def prefix_blind_policy(document: Mapping[str, Any] | None = None) -> SimPolicy:
    """prfaas's policy as if no region had a prefix cache: every prompt token computed, placed by its length."""
    return SimPolicy("prfaas-prefix-blind", policy_from_mapping(document or _default_document()), prefix_aware=False)


def homogeneous_pd_policy(document: Mapping[str, Any] | None = None) -> SimPolicy:
    doc = _with(document or _default_document(), min_uncached_tokens=2**62)
    return SimPolicy("homogeneous-pd", policy_from_mapping(doc), FleetShape.HOMOGENEOUS)


def homogeneous_pd_equal_cost_policy(document: Mapping[str, Any] | None = None) -> SimPolicy:
    doc = _with(document or _default_document(), min_uncached_tokens=2**62)
    return SimPolicy("homogeneous-pd-equal-cost", policy_from_mapping(doc), FleetShape.HOMOGENEOUS_COST)


def naive_heterogeneous_policy(document: Mapping[str, Any] | None = None) -> SimPolicy:
    doc = _with(document or _default_document(), min_uncached_tokens=0, min_cost_gain=0.0, min_ttft_gain=0.0)
    filters = doc["profiles"]["prefill"]["filters"]
    doc["profiles"]["prefill"]["filters"] = [{"type": "split-only"}, *filters]
    return SimPolicy("naive-heterogeneous", policy_from_mapping(doc), FleetShape.DECODE_ONLY_PD)


def policy_with_threshold(policy: SimPolicy, min_uncached_tokens: int) -> SimPolicy:
    """The same policy with another disaggregation threshold."""
    disaggregation = policy.config.disaggregation.model_copy(update={"min_uncached_tokens": min_uncached_tokens})
    return replace(policy, config=policy.config.model_copy(update={"disaggregation": disaggregation}))


def split_by_length_policy(min_uncached_tokens: int) -> SimPolicy:
    """Split every request whose uncached prompt reaches the threshold (when a link survives the
    filters), never the shorter ones: placement by length alone."""
    doc = _with(_default_document(), min_uncached_tokens=min_uncached_tokens, min_cost_gain=0.0, min_ttft_gain=0.0)
    filters = doc["profiles"]["prefill"]["filters"]
    rule = {"type": "split-above", "params": {"min_uncached_tokens": min_uncached_tokens}}
    doc["profiles"]["prefill"]["filters"] = [rule, *filters]
    return SimPolicy("split-by-length", policy_from_mapping(doc))


NEVER_SPLITS = frozenset({"homogeneous-pd", "homogeneous-pd-equal-cost"})  # their threshold does not apply
DEFAULT_POLICIES = ("prfaas", "homogeneous-pd", "homogeneous-pd-equal-cost", "naive-heterogeneous")

BASELINES = {
    "prfaas": prfaas_policy,
    "prfaas-prefix-blind": prefix_blind_policy,
    "homogeneous-pd": homogeneous_pd_policy,
    "homogeneous-pd-equal-cost": homogeneous_pd_equal_cost_policy,
    "naive-heterogeneous": naive_heterogeneous_policy,
}
