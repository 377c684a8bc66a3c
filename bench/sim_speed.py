"""Simulator speed: N requests over a 10,000-GPU, 10-region fleet with the live scheduler.

Target (issue 9): 100k requests over 10,000 GPUs in under 2 minutes on the 2-core host.
    .venv/bin/python bench/sim_speed.py [--requests 100000] [--rate 150] [--model hybrid-1t]
Prints wall and CPU time (the host is shared: CPU time is what this process used), requests/s
simulated, the scheduler's share of the wall time, what became
of the requests (rejection reasons) and how busy each pool and link was, so a rejection share
can be read off the load rather than guessed.

Fleet: 5 H200 prefill-only regions (100 workers x 8 GPUs) and 5 H20 PD regions (25 prefill +
50 decode workers x 16 GPUs: the 1T fp8 weights need 16 x 96 GB), every prefill region linked to
every PD region at 100 Gbps. `--model dense-70b` (8-GPU H20 workers) shows a WAN-bound fleet:
its KV is ~47x larger per token, and at 150 req/s the long prompts alone want ~1.3 TB/s of
wire against 281 GB/s of goodput on the 25 links.
"""

from __future__ import annotations

import argparse
import collections
import time

from prfaas.control_plane.scheduling import Slo
from prfaas.sim.experiment import summarize
from prfaas.sim.fleet import FleetSpec, LinkSpec, RegionSpec
from prfaas.sim.policies import prfaas_policy
from prfaas.sim.simulator import Outcome, Simulation
from prfaas.sim.workload import agentic_long_context_mix


def big_fleet(model: str = "hybrid-1t") -> FleetSpec:
    pd_gpus = 16 if model == "hybrid-1t" else 8
    pd_workers = (25, 50) if pd_gpus == 16 else (50, 100)
    prefill = [RegionSpec(f"pf{i}", "H200", num_prefill_workers=100) for i in range(5)]
    pd = [
        RegionSpec(
            f"pd{i}",
            "H20",
            num_prefill_workers=pd_workers[0],
            num_decode_workers=pd_workers[1],
            gpus_per_worker=pd_gpus,
        )
        for i in range(5)
    ]
    links = [LinkSpec(p.name, d.name, 100.0, 10.0 + 5 * i, 0.02) for i, p in enumerate(prefill) for d in pd]
    return FleetSpec(model, (*prefill, *pd), tuple(links))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=100_000)
    parser.add_argument("--rate", type=float, default=150.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default="hybrid-1t", choices=["hybrid-1t", "dense-70b"])
    args = parser.parse_args()
    fleet = big_fleet(args.model)
    arrivals = agentic_long_context_mix().generate(args.rate, args.requests, args.seed)
    slo = Slo(ttft_ms=30_000, tpot_ms=100)
    sim = Simulation(fleet, prfaas_policy().scheduler(), slo)
    start, cpu_start = time.perf_counter(), time.process_time()
    records = sim.run(arrivals)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    metrics = summarize(sim, records, slo, args.rate)
    outcomes = collections.Counter(
        r.mode if r.outcome is Outcome.COMPLETED else f"rejected:{r.reason}" for r in records
    )
    print(f"{fleet.num_gpus} GPUs, {len(fleet.regions)} regions, {len(fleet.links)} links, {fleet.model}")
    print(f"{args.requests} requests at {args.rate:g} req/s (agentic long-context mix), seed {args.seed}")
    rate = args.requests / wall
    print(f"wall {wall:.1f} s, CPU {cpu:.1f} s ({rate:,.0f} requests/s simulated), target < 120 s for 100k")
    print(f"snapshot + scheduler decisions {sim.decisions_s:.1f} s = {sim.decisions_s / wall:.0%} of wall")
    print(f"outcomes: {dict(sorted(outcomes.items()))}; simulated {sim.now:,.0f} s")
    print(
        f"SLO attainment {metrics.slo_attainment:.1%}, TTFT P50/P90 {metrics.ttft_p50_s:.2f}/{metrics.ttft_p90_s:.2f} s"
    )
    busiest = sorted(metrics.gpu_util.items(), key=lambda kv: -kv[1])[:4]
    print("busiest pools: " + ", ".join(f"{name} {util:.0%}" for name, util in busiest))
    print(f"busiest link {metrics.link_util:.1%} of line rate; all links {sum(metrics.link_gbps.values()):.0f} Gbps")


if __name__ == "__main__":
    main()
