"""PrfaaS's own analytic throughput model (arXiv 2604.15039, §3.4, Eq. 3-6), evaluated on a
scenario's fleet, profiles and workload: the figure the paper reports as throughput, beside
the simulation's throughput at SLO.

    Θprfaas = min(N_prfaas / T_prefill(l_long), B_out / S_kv(l_long))   (H200 prefill region)
    Θpd-p   = N_p / T_prefill(l_short)                                   (PD cluster prefill)
    Θpd-d   = N_d * BS_max / (T_decode * L_out)                          (PD cluster decode)
    Λmax    = min(Θprfaas / p, Θpd-p / (1 - p), Θpd-d)

with p = P(L >= t), l_long = E[L | L >= t], l_short = E[L | L < t] over the workload's uncached
lengths (sampled; the scheduler splits a prompt of exactly t uncached tokens), and every pool
serving its mean length at its steady rate: no queueing, no burst, no SLO on TTFT. Homogeneous
PD is p = 0 on the folded fleet; naive heterogeneous p = 1.
One prefill-only region and one PD cluster (the case study's shape).
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass

from prfaas.sim.fleet import FleetSpec, RegionSpec
from prfaas.sim.workload import Workload


@dataclass(frozen=True)
class AnalyticPoint:
    threshold: int | None  # None: no split (homogeneous) ; 0: every request splits (naive)
    prefill_workers: int  # N_p of the PD cluster
    decode_workers: int  # N_d
    split_share: float  # p
    theta_prfaas: float
    theta_pd_p: float
    theta_pd_d: float
    lambda_max: float


def _pools(fleet: FleetSpec) -> tuple[RegionSpec | None, RegionSpec]:
    remote = [r for r in fleet.regions if not r.num_decode_workers]
    pd = [r for r in fleet.regions if r.num_decode_workers]
    if len(pd) != 1 or len(remote) > 1:
        raise ValueError("the analytic model takes one PD cluster and at most one prefill-only region")
    return (remote[0] if remote else None), pd[0]


class Lengths:
    """Sorted uncached lengths with prefix sums: P(L > t) and the conditional means in O(log n)."""

    def __init__(self, lengths: list[int]) -> None:
        if not lengths:
            raise ValueError("no lengths")
        self.sorted = sorted(lengths)
        self.sums = [0, *itertools.accumulate(self.sorted)]

    def split(self, threshold: int | None) -> tuple[float, float | None, float | None]:
        """p, E[L | L >= t] and E[L | L < t] (None where no length falls): the scheduler splits at
        uncached >= min_uncached_tokens, so a length at the threshold is long."""
        n = len(self.sorted)
        k = n if threshold is None else bisect.bisect_left(self.sorted, threshold)
        short = self.sums[k] / k if k else None
        long = (self.sums[n] - self.sums[k]) / (n - k) if k < n else None
        return (n - k) / n, long, short


def evaluate(
    fleet: FleetSpec,
    lengths: Lengths,
    output_tokens: float,
    threshold: int | None,
    prefill_workers: int,
    decode_workers: int,
) -> AnalyticPoint:
    """Λmax of one configuration; `threshold` None keeps every prefill in the PD cluster."""
    remote, pd = _pools(fleet)
    pd_worker = fleet.worker(pd)
    p, l_long, l_short = lengths.split(threshold if remote is not None else None)
    theta_prfaas = theta_pd_p = 0.0
    if l_long is not None and remote is not None:
        model = fleet.model_profile
        kv_bytes = model.kv_state_bytes + l_long * model.kv_bytes_per_token
        link = next(lk for lk in fleet.links if lk.src == remote.name and lk.dst == pd.name)
        theta_prfaas = min(
            remote.num_prefill_workers / fleet.worker(remote).prefill_s(round(l_long)),
            link.bandwidth_gbps * 1e9 / 8 / kv_bytes,
        )
    if l_short is not None and prefill_workers:
        theta_pd_p = prefill_workers / pd_worker.prefill_s(round(l_short))
    batch = pd_worker.max_batch
    if batch is None:
        raise ValueError("the analytic model needs a decode batch cap (profiled timings)")
    theta_pd_d = decode_workers * batch / (pd_worker.decode_step_s(batch, 0) * output_tokens)
    bounds = [theta_pd_d]
    if p > 0:
        bounds.append(theta_prfaas / p)
    if p < 1:
        bounds.append(theta_pd_p / (1 - p))
    return AnalyticPoint(
        threshold, prefill_workers, decode_workers, p, theta_prfaas, theta_pd_p, theta_pd_d, min(bounds)
    )


def sample_lengths(workload: Workload, n: int = 200_000, seed: int = 0) -> tuple[Lengths, float]:
    """Uncached prompt lengths and the mean output length of `n` draws."""
    arrivals = workload.generate(1.0, n, seed)
    mean_out = sum(a.output_tokens for a in arrivals) / n
    return Lengths([a.prompt_tokens - a.cached_tokens for a in arrivals]), mean_out


def best(fleet: FleetSpec, lengths: Lengths, output_tokens: float, thresholds: list[int | None]) -> AnalyticPoint:
    """The grid search of §4.2: every threshold x every prefill:decode split of the PD cluster."""
    _, pd = _pools(fleet)
    total = pd.num_prefill_workers + pd.num_decode_workers
    points = [
        evaluate(fleet, lengths, output_tokens, t, n_p, total - n_p)
        for t in thresholds
        for n_p in range(0 if t == 0 else 1, total)
    ]
    return max(points, key=lambda q: q.lambda_max)


def paper_table(
    fleet: FleetSpec, homogeneous: FleetSpec, naive: FleetSpec, workload: Workload
) -> dict[str, AnalyticPoint]:
    """Each deployment of the paper's Table 6 at its own optimum (threshold grid 0.1K apart)."""
    lengths, out = sample_lengths(workload)
    grid: list[int | None] = list(range(1_000, 64_001, 100))
    return {
        "prfaas": best(fleet, lengths, out, grid),
        "homogeneous-pd": best(homogeneous, lengths, out, [None]),
        "naive-heterogeneous": best(naive, lengths, out, [0]),
    }
