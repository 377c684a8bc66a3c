"""prfaas.control_plane.scheduling: the global scheduler (pure policy: a frozen snapshot and a
request in, a decision out; no I/O, so the control plane and the simulator run the same objects).

    from prfaas.control_plane.scheduling import build_scheduler, ClusterSnapshot, Request
    decision = build_scheduler().decide(snapshot, request)   # or raises PlacementRejected

Everything a caller needs is importable from here. Modules: `snapshot` (ClusterSnapshot, Region,
Link), `request` (Request, Slo), `costmodel`, `plugins` (the filter / scorer / picker contracts),
`filters`, `scorers`, `plugin_registry` (type string -> factory), `scheduler` (GlobalScheduler),
`policy` (YAML), `decision` (Decision, Explanation), `errors`, `explain` (`prfaas sched explain`).
"""

from prfaas.control_plane.scheduling.costmodel import CodecOption, CostModel, Estimate, TransferPlan
from prfaas.control_plane.scheduling.decision import (
    Cost,
    Decision,
    Explanation,
    Mode,
    StageTrace,
    decision_dict,
    decision_json,
)
from prfaas.control_plane.scheduling.errors import (
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
from prfaas.control_plane.scheduling.plugin_registry import PluginRegistry, default_registry
from prfaas.control_plane.scheduling.plugins import Candidate, Context, Filter, Picker, Scorer, Stage
from prfaas.control_plane.scheduling.policy import (
    DEFAULT_POLICY_YAML,
    PolicyConfig,
    build_scheduler,
    default_policy,
    load_policy,
    parse_policy,
    policy_from_mapping,
)
from prfaas.control_plane.scheduling.request import Priority, Request, Slo
from prfaas.control_plane.scheduling.scheduler import (
    DisaggregationRule,
    GlobalScheduler,
    NamedFilter,
    Profile,
    WeightedScorer,
)
from prfaas.control_plane.scheduling.snapshot import ClusterSnapshot, Link, ModelShape, Region, Role

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
