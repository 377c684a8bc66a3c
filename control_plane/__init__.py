"""prfaas.control_plane

The global scheduler's public surface (pure policy: snapshot and request in, decision out):

    from prfaas.control_plane import build_scheduler, ClusterSnapshot, Request
    decision = build_scheduler().decide(snapshot, request)   # or raises PlacementRejected

Modules: `snapshot` (ClusterSnapshot, Region, Link), `request` (Request, Slo), `costmodel`,
`plugins` (contracts), `filters`, `scorers`, `registry`, `scheduler` (GlobalScheduler),
`policy` (YAML), `decision` (Decision, Explanation), `errors`, `explain` (CLI), `synthetic`.
"""

from prfaas.control_plane.costmodel import CodecOption, CostModel, Estimate, TransferPlan
from prfaas.control_plane.decision import Cost, Decision, Explanation, Mode, StageTrace, decision_dict, decision_json
from prfaas.control_plane.errors import (
    InsufficientCapacity,
    InvalidSchedulerInput,
    LinksSaturated,
    NoEligibleRegion,
    NoHealthyRegion,
    PlacementRejected,
    PolicyConfigError,
    RejectReason,
    ResidencyUnsatisfiable,
    SchedulerError,
    SloUnattainable,
    UnknownPluginType,
)
from prfaas.control_plane.plugins import Candidate, Context, Filter, Picker, Scorer, Stage
from prfaas.control_plane.policy import (
    DEFAULT_POLICY_YAML,
    PolicyConfig,
    build_scheduler,
    default_policy,
    load_policy,
    parse_policy,
    policy_from_mapping,
)
from prfaas.control_plane.registry import PluginRegistry, default_registry
from prfaas.control_plane.request import Priority, Request, Slo
from prfaas.control_plane.scheduler import DisaggregationRule, GlobalScheduler, NamedFilter, Profile, WeightedScorer
from prfaas.control_plane.snapshot import ClusterSnapshot, Link, ModelShape, Region, Role

__all__ = [
    "DEFAULT_POLICY_YAML",
    "Candidate",
    "ClusterSnapshot",
    "CodecOption",
    "Context",
    "Cost",
    "CostModel",
    "Decision",
    "DisaggregationRule",
    "Estimate",
    "Explanation",
    "Filter",
    "GlobalScheduler",
    "InsufficientCapacity",
    "InvalidSchedulerInput",
    "Link",
    "LinksSaturated",
    "Mode",
    "ModelShape",
    "NamedFilter",
    "NoEligibleRegion",
    "NoHealthyRegion",
    "Picker",
    "PlacementRejected",
    "PluginRegistry",
    "PolicyConfig",
    "PolicyConfigError",
    "Priority",
    "Profile",
    "Region",
    "RejectReason",
    "Request",
    "ResidencyUnsatisfiable",
    "Role",
    "SchedulerError",
    "Scorer",
    "Slo",
    "SloUnattainable",
    "Stage",
    "StageTrace",
    "TransferPlan",
    "UnknownPluginType",
    "WeightedScorer",
    "build_scheduler",
    "decision_dict",
    "decision_json",
    "default_policy",
    "default_registry",
    "load_policy",
    "parse_policy",
    "policy_from_mapping",
]
