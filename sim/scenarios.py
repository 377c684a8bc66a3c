"""Named scenarios: a fleet, a workload, SLOs and the run size. `prfaas sim scenarios` lists them."""

from __future__ import annotations

from dataclasses import dataclass

from prfaas.control_plane.request import Slo
from prfaas.sim.fleet import FleetSpec, LinkSpec, RegionSpec
from prfaas.sim.workload import Workload, agentic_long_context_mix, chat_workload


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    fleet: FleetSpec
    workload: Workload
    slo: Slo
    num_requests: int
    start_rps: float  # first rate the throughput search tries
    paper: dict[str, float] | None = None  # published figures to print beside ours


def case_study() -> Scenario:
    """PrfaaS (arXiv 2604.15039): a 32-H200 prefill region and a 64-H20 PD cluster joined by a
    100 Gbps inter-DC link, serving a 1T-class hybrid-attention model on a long-context mix.
    The H20 cluster holds the 1T fp8 weights on 16-GPU workers (8 x 96 GB is too small)."""
    fleet = FleetSpec(
        model="hybrid-1t",
        regions=(
            RegionSpec("h200-prefill", "H200", num_prefill_workers=4, gpus_per_worker=8),
            RegionSpec("h20-pd", "H20", num_prefill_workers=2, num_decode_workers=2, gpus_per_worker=16),
        ),
        links=(LinkSpec("h200-prefill", "h20-pd", bandwidth_gbps=100.0, rtt_ms=10.0, egress_usd_per_gb=0.0),),
    )
    return Scenario(
        "prfaas-case-study",
        "32 H200 prefill + 64 H20 PD, 100 Gbps, hybrid-1t, agentic long-context mix",
        fleet,
        agentic_long_context_mix(),
        Slo(ttft_ms=30_000, tpot_ms=100),
        num_requests=300,
        start_rps=0.1,
        paper={
            "gain_vs_homogeneous": 0.54,
            "gain_vs_equal_cost": 0.15,  # "about 15%" at equal hardware cost, as reported
            "gain_vs_naive": 0.32,
            "p90_ttft_cut": 0.64,
            "link_gbps": 13.0,
        },
    )


def small() -> Scenario:
    """A two-region dense-8B fleet on a chat mix: seconds to run, used by the tests."""
    fleet = FleetSpec(
        model="dense-8b",
        regions=(
            RegionSpec("cheap", "L40S", num_prefill_workers=4, gpus_per_worker=1),
            RegionSpec("pd", "H100", num_prefill_workers=1, num_decode_workers=2, gpus_per_worker=1),
        ),
        links=(LinkSpec("cheap", "pd", bandwidth_gbps=25.0, rtt_ms=20.0, egress_usd_per_gb=0.02),),
    )
    return Scenario(
        "small",
        "L40S prefill + H100 PD, dense-8b, chat",
        fleet,
        chat_workload(),
        Slo(ttft_ms=2_000, tpot_ms=60),
        200,
        2.0,
    )


SCENARIOS = {"prfaas-case-study": case_study, "small": small}
