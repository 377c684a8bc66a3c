"""Simulator speed: N requests over a ~10,000-GPU, 10-region fleet with the live scheduler.

Target (issue 9): 100k requests over 10,000 GPUs in under 2 minutes on the 2-core host.
    .venv/bin/python bench/sim_speed.py [--requests 100000] [--rate 150]
Prints wall time, requests/s simulated, and the scheduler's share of the wall time.
"""

from __future__ import annotations

import argparse
import time

from prfaas.control_plane.request import Slo
from prfaas.sim.fleet import FleetSpec, LinkSpec, RegionSpec
from prfaas.sim.policies import prfaas_policy
from prfaas.sim.simulator import Outcome, Simulation
from prfaas.sim.workload import agentic_long_context_mix


def big_fleet() -> FleetSpec:
    prefill = [RegionSpec(f"pf{i}", "H200", num_prefill_workers=100) for i in range(5)]
    pd = [RegionSpec(f"pd{i}", "H20", num_prefill_workers=50, num_decode_workers=100) for i in range(5)]
    links = [LinkSpec(p.name, d.name, 100.0, 10.0 + 5 * i, 0.02) for i, p in enumerate(prefill) for d in pd]
    return FleetSpec("dense-70b", (*prefill, *pd), tuple(links))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=100_000)
    parser.add_argument("--rate", type=float, default=150.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    fleet = big_fleet()
    arrivals = agentic_long_context_mix().generate(args.rate, args.requests, args.seed)
    sim = Simulation(fleet, prfaas_policy().scheduler(), Slo(ttft_ms=30_000, tpot_ms=100))
    start = time.perf_counter()
    records = sim.run(arrivals)
    wall = time.perf_counter() - start
    done = sum(1 for r in records if r.outcome is Outcome.COMPLETED)
    split = sum(1 for r in records if r.mode == "split")
    print(f"{fleet.num_gpus} GPUs, {len(fleet.regions)} regions, {len(fleet.links)} links, {args.requests} requests")
    print(f"wall {wall:.1f} s ({args.requests / wall:,.0f} requests/s simulated), target < 120 s for 100k")
    print(f"snapshot + scheduler decisions {sim.decisions_s:.1f} s = {sim.decisions_s / wall:.0%} of wall")
    print(f"completed {done}, rejected {len(records) - done}, split {split}, simulated {sim.now:.0f} s")


if __name__ == "__main__":
    main()
