"""The policies a simulation compares: each is a scheduler policy (the same YAML document the
control plane loads) plus which part of the fleet it may use.

- `prfaas`: the default policy (conditional disaggregation over the whole fleet).
- `homogeneous-pd`: the PD clusters alone (prefill-only regions dropped); never splits.
- `naive-heterogeneous`: every request splits to a prefill region (a `split-only` filter cuts
  the local candidate); rejected when no split survives the filters.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import yaml
from pydantic import BaseModel, ConfigDict

from prfaas.control_plane.errors import RejectReason
from prfaas.control_plane.plugins import Candidate, Context
from prfaas.control_plane.policy import DEFAULT_POLICY_YAML, PolicyConfig, build_scheduler, policy_from_mapping
from prfaas.control_plane.registry import PluginRegistry, default_registry
from prfaas.control_plane.scheduler import GlobalScheduler
from prfaas.sim.fleet import FleetSpec


class SplitOnlyFilter(BaseModel):
    """`split-only`: cut the local candidate in the prefill stage (the naive baseline)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    reason: ClassVar[RejectReason] = RejectReason.NO_ELIGIBLE_REGION

    def keep(self, ctx: Context, candidate: Candidate) -> bool:
        return candidate.link is not None


def sim_registry() -> PluginRegistry:
    """The built-in plugins plus the baselines' `split-only` filter."""
    registry = default_registry()
    registry.register_filter("split-only", lambda params: SplitOnlyFilter.model_validate(dict(params)))
    return registry


@dataclass(frozen=True)
class SimPolicy:
    name: str
    config: PolicyConfig
    prefill_only_regions: bool = True  # False: the fleet loses its prefill-only regions

    def scheduler(self) -> GlobalScheduler:
        return build_scheduler(self.config, sim_registry())

    def fleet_for(self, fleet: FleetSpec) -> FleetSpec:
        if self.prefill_only_regions:
            return fleet
        kept = tuple(r for r in fleet.regions if r.num_decode_workers)
        names = {r.name for r in kept}
        return replace(fleet, regions=kept, links=tuple(lk for lk in fleet.links if {lk.src, lk.dst} <= names))


def _default_document() -> dict[str, Any]:
    document: dict[str, Any] = yaml.safe_load(DEFAULT_POLICY_YAML)
    return document


def _with(document: Mapping[str, Any], **disaggregation: Any) -> dict[str, Any]:
    out = copy.deepcopy(dict(document))
    out["disaggregation"] = {**out.get("disaggregation", {}), **disaggregation}
    return out


def prfaas_policy(document: Mapping[str, Any] | None = None) -> SimPolicy:
    return SimPolicy("prfaas", policy_from_mapping(document or _default_document()))


def homogeneous_pd_policy(document: Mapping[str, Any] | None = None) -> SimPolicy:
    doc = _with(document or _default_document(), min_uncached_tokens=2**62)
    return SimPolicy("homogeneous-pd", policy_from_mapping(doc), prefill_only_regions=False)


def naive_heterogeneous_policy(document: Mapping[str, Any] | None = None) -> SimPolicy:
    doc = _with(document or _default_document(), min_uncached_tokens=0, min_cost_gain=0.0, min_ttft_gain=0.0)
    filters = doc["profiles"]["prefill"]["filters"]
    doc["profiles"]["prefill"]["filters"] = [{"type": "split-only"}, *filters]
    return SimPolicy("naive-heterogeneous", policy_from_mapping(doc))


BASELINES = {
    "prfaas": prfaas_policy,
    "homogeneous-pd": homogeneous_pd_policy,
    "naive-heterogeneous": naive_heterogeneous_policy,
}
