"""`prfaas sim plan`: PrfaaS's long-timescale step as a grid search. For each disaggregation
threshold (`min_uncached_tokens`) and each prefill:decode split of the PD clusters' workers,
the throughput at SLO of the policy on that fleet; the recommended point is the highest
throughput, ties (within `tie`) broken by the lower $ per 1M tokens."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from prfaas.sim.experiment import RunMetrics, measure, throughput_at_slo
from prfaas.sim.fleet import FleetSpec
from prfaas.sim.policies import BASELINES, NEVER_SPLITS, SimPolicy, policy_with_threshold
from prfaas.sim.scenarios import Scenario
from prfaas.sim.workload import Arrival

PLANNABLE = ("prfaas", "homogeneous-pd", "homogeneous-pd-equal-cost")
DEFAULT_THRESHOLDS = (0, 4_096, 8_192, 12_288, 16_384, 19_400, 24_576, 32_768, 49_152, 65_536)


@dataclass(frozen=True)
class PlanPoint:
    threshold: int | None  # None: the policy never splits, the threshold does not apply
    prefill_workers: dict[str, int]  # PD cluster -> prefill workers (the rest decode)
    decode_workers: dict[str, int]
    throughput_at_slo_rps: float
    ttft_p90_s: float | None
    usd_per_mtok: float | None
    split_share: float | None  # share of the completed requests that split, at the rate at SLO

    def as_row(self) -> dict[str, Any]:
        return dict(self.__dict__)


def with_split(fleet: FleetSpec, prefill_share: float) -> FleetSpec:
    """Every PD cluster keeps its worker count and gives `prefill_share` of it (rounded, at
    least one each side) to prefill."""
    regions = []
    for region in fleet.regions:
        if region.num_decode_workers:
            total = region.num_prefill_workers + region.num_decode_workers
            prefill = min(total - 1, max(1, round(total * prefill_share)))
            region = replace(region, num_prefill_workers=prefill, num_decode_workers=total - prefill)
        regions.append(region)
    return replace(fleet, regions=tuple(regions))


def split_shares(fleet: FleetSpec) -> list[float]:
    """The distinct prefill shares the smallest PD cluster can express (1/n .. (n-1)/n)."""
    totals = [r.num_prefill_workers + r.num_decode_workers for r in fleet.regions if r.num_decode_workers]
    if not totals or min(totals) < 2:
        return []
    n = min(totals)
    return [k / n for k in range(1, n)]


def evaluate(
    fleet: FleetSpec, policy: SimPolicy, scenario: Scenario, draw: Callable[[float], list[Arrival]], start_rps: float
) -> PlanPoint:
    """Throughput at SLO of `policy` on `fleet` (already shaped for the policy)."""

    def run_at(rate: float) -> RunMetrics:
        return measure(fleet, policy, scenario.slo, draw(rate), rate, shape=False)

    result = throughput_at_slo(run_at, start_rps, target=scenario.slo_target)
    at = result.at_slo
    pd = [r for r in fleet.regions if r.num_decode_workers]
    return PlanPoint(
        threshold=None if policy.name in NEVER_SPLITS else policy.config.disaggregation.min_uncached_tokens,
        prefill_workers={r.name: r.num_prefill_workers for r in pd},
        decode_workers={r.name: r.num_decode_workers for r in pd},
        throughput_at_slo_rps=result.throughput_at_slo_rps,
        ttft_p90_s=None if at is None else at.ttft_p90_s,
        usd_per_mtok=None if at is None else at.usd_per_mtok,
        split_share=None if at is None or not at.num_completed else at.num_split / at.num_completed,
    )


def plan(
    scenario: Scenario,
    draw: Callable[[float], list[Arrival]],
    *,
    policy: str = "prfaas",
    thresholds: Sequence[int] | None = None,
    shares: Sequence[float] | None = None,
    on_point: Callable[[PlanPoint], None] | None = None,
) -> list[PlanPoint]:
    """Every grid point, in grid order. `shares` default: every split the smallest PD cluster
    can express; `thresholds` default: `DEFAULT_THRESHOLDS` (ignored by `homogeneous-pd`)."""
    if policy not in PLANNABLE:
        raise ValueError(
            f"plan tunes {sorted(PLANNABLE)}, not {policy!r} (naive-heterogeneous has no pool split to tune)"
        )
    base = BASELINES[policy]()
    shaped = base.fleet_for(scenario.fleet)
    grid_shares = list(shares) if shares is not None else split_shares(shaped)
    if any(not 0 < s < 1 for s in grid_shares):
        raise ValueError("prefill shares must be strictly between 0 and 1")
    if not grid_shares:
        grid_shares = [_share(shaped)]
    grid_thresholds: list[int | None] = [None] if policy in NEVER_SPLITS else list(thresholds or DEFAULT_THRESHOLDS)
    if any(t is not None and t < 0 for t in grid_thresholds):
        raise ValueError("thresholds must be non-negative token counts")
    points = []
    seen: set[tuple[tuple[str, int], ...]] = set()
    for share in grid_shares:
        fleet = with_split(shaped, share)
        key = tuple((r.name, r.num_prefill_workers) for r in fleet.regions)
        if key in seen:
            continue  # two shares rounding to the same split
        seen.add(key)
        for threshold in grid_thresholds:
            chosen = base if threshold is None else policy_with_threshold(base, threshold)
            point = evaluate(fleet, chosen, scenario, draw, scenario.start_rps)
            points.append(point)
            if on_point is not None:
                on_point(point)
    return points


def _share(fleet: FleetSpec) -> float:
    pd = [r for r in fleet.regions if r.num_decode_workers]
    prefill = sum(r.num_prefill_workers for r in pd)
    return prefill / sum(r.num_prefill_workers + r.num_decode_workers for r in pd) if pd else 0.5


def recommend(points: Sequence[PlanPoint], tie: float = 0.02) -> PlanPoint:
    """The highest throughput at SLO; within `tie` of it, the lowest $ per 1M tokens."""
    if not points:
        raise ValueError("no plan points")
    best = max(p.throughput_at_slo_rps for p in points)
    close = [p for p in points if p.throughput_at_slo_rps >= best * (1 - tie)]
    return min(
        close, key=lambda p: (p.usd_per_mtok if p.usd_per_mtok is not None else float("inf"), -p.throughput_at_slo_rps)
    )


def recommended_yaml(point: PlanPoint) -> str:
    """The recommendation as the policy and pool settings to apply."""
    lines = []
    if point.threshold is not None:
        lines += ["disaggregation:", f"  min_uncached_tokens: {point.threshold}"]
    lines.append("pools:")
    for name, prefill in point.prefill_workers.items():
        lines.append(f"  {name}: {{prefill_workers: {prefill}, decode_workers: {point.decode_workers[name]}}}")
    return "\n".join(lines)
