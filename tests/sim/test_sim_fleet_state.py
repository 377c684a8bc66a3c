"""What the modelled fleet reports to the scheduler (sim/fleet_state.py): the live control plane's snapshot."""

from __future__ import annotations

import pytest

from prfaas.control_plane.scheduling import ClusterSnapshot, Decision, Request, Slo
from prfaas.sim.fleet import FleetSpec, RegionSpec
from prfaas.sim.policies import prfaas_policy
from prfaas.sim.simulator import Simulation
from prfaas.sim.workload import Arrival


def test_a_shared_slot_region_reports_its_queue_in_jobs_as_the_live_decode_region_does() -> None:
    # One engine slot, held by a request from its prefill to its last token (the local decode region). Request 1
    # holds it for ~21 s of decode when request 2 arrives: the queued and running prompt tokens (0 and 0) say
    # nothing of that, so the scheduler predicted 0 s of wait. The live registry reports such a region's queue in
    # jobs (queued_prefill_tokens None) with its mean slot-holding time; request 0's hold (2.18 s) is that mean.
    fleet = FleetSpec("dense-8b", (RegionSpec("d", "H100", 1, 1, gpus_per_worker=1, shared_workers=True),))
    scheduler = prfaas_policy().scheduler()
    seen: list[tuple[ClusterSnapshot, Decision]] = []
    decide = scheduler.decide

    def watched(snapshot: ClusterSnapshot, request: Request) -> Decision:
        seen.append((snapshot, decide(snapshot, request)))
        return seen[-1][1]

    scheduler.decide = watched  # type: ignore[method-assign]
    sim = Simulation(fleet, scheduler, Slo(ttft_ms=600_000, tpot_ms=1000))
    records = sim.run([Arrival(0.0, 500, 200), Arrival(10.0, 500, 2000), Arrival(11.0, 500, 10)])
    first_hold_s = records[0].finish_s - records[0].arrival_s
    snapshot, decision = seen[2]
    region = snapshot.region("d")
    assert (region.num_busy_workers, region.queued_prefill_tokens) == (1, None)
    assert region.mean_prefill_s == pytest.approx(first_hold_s)
    assert decision.predicted_queue_wait_ms == pytest.approx(first_hold_s * 1000)  # (0 ahead + 1) x the mean hold
    assert records[2].ttft_s > 20.0  # it did wait: for request 1's last token
