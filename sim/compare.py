"""`prfaas sim run`: every policy's throughput at SLO on one scenario, side by side; the rows
`--json` writes; the scenario's published figures next to ours when it has them."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from prfaas.sim import analytic
from prfaas.sim.experiment import RunMetrics, comparison_row, measure, throughput_at_slo
from prfaas.sim.fleet import FleetSpec
from prfaas.sim.planner import PLANNABLE, PlanPoint, plan, recommend, with_split
from prfaas.sim.policies import (
    BASELINES,
    DEFAULT_POLICIES,
    SimPolicy,
    decode_only_pd_fleet,
    homogeneous_fleet,
    policy_with_threshold,
)
from prfaas.sim.scenarios import SCENARIOS, Scenario
from prfaas.sim.workload import Arrival, Workload, load_trace, scale_rate


def arrivals_for(scenario: Scenario, trace: list[Arrival] | None, seed: int) -> Callable[[float], list[Arrival]]:
    """Rate -> arrivals: the scenario's workload drawn at that rate, or the trace replayed at it."""
    if trace is None:
        return lambda rate: scenario.workload.generate(rate, scenario.num_requests, seed)
    span = trace[-1].at_s - trace[0].at_s
    if span <= 0:  # no rate of its own to scale from
        raise ValueError("a trace replayed at a rate needs arrivals at two times or more")
    native = (len(trace) - 1) / span  # n arrivals span n - 1 gaps
    return lambda rate: scale_rate(trace, rate / native)


def trace_arrivals(path: str | Path, num_requests: int | None = None) -> list[Arrival]:
    """The trace's arrivals, or (`num_requests`, `--requests`) its first `num_requests` of them."""
    if num_requests is not None and num_requests < 1:
        raise ValueError("requests must be at least 1")
    arrivals = load_trace(path)
    return arrivals if num_requests is None else arrivals[:num_requests]


def load_scenario(scenario_name: str, num_requests: int | None = None) -> Scenario:
    if scenario_name not in SCENARIOS:
        raise ValueError(f"unknown scenario {scenario_name!r}; known: {sorted(SCENARIOS)}")
    scenario = SCENARIOS[scenario_name]()
    if num_requests is not None:
        if num_requests < 1:
            raise ValueError("requests must be at least 1")
        scenario = replace(scenario, num_requests=num_requests)
    return scenario


def compare(
    scenario_name: str,
    *,
    policies: Sequence[str] | None = None,
    seed: int = 0,
    num_requests: int | None = None,
    trace_path: str | None = None,
    tune: bool = False,
    on_run: Callable[[str, RunMetrics], None] | None = None,
) -> list[dict[str, Any]]:
    """One row per policy (default: `DEFAULT_POLICIES`; see `experiment.comparison_row`).
    `tune`: each policy on its own best prefill:decode split (and prfaas at its best
    threshold), found by `planner.plan`, as PrfaaS grid-searches its baselines too; the row
    says which (`tuned`)."""
    scenario = load_scenario(scenario_name, num_requests)
    trace = trace_arrivals(trace_path, num_requests) if trace_path else None
    draw = arrivals_for(scenario, trace, seed)
    rows = []
    policy_of: dict[str, SimPolicy] = {}
    fleet_of: dict[str, FleetSpec] = {}
    for name in policies or DEFAULT_POLICIES:
        if name not in BASELINES:
            raise ValueError(f"unknown policy {name!r}; known: {sorted(BASELINES)}")
        policy = BASELINES[name]()
        fleet = policy.fleet_for(scenario.fleet)
        tuned: dict[str, Any] | None = None
        if tune and name in PLANNABLE:
            best = recommend(plan(scenario, draw, policy=name))
            fleet = with_split(fleet, _share_of(best))
            if best.threshold is not None:
                policy = policy_with_threshold(policy, best.threshold)
            tuned = {
                "threshold": best.threshold,
                "prefill_workers": best.prefill_workers,
                "decode_workers": best.decode_workers,
            }
        elif name in scenario.prefill_share:
            fleet = with_split(fleet, scenario.prefill_share[name])
        policy_of[name], fleet_of[name] = policy, fleet

        def run_at(rate: float, policy_name: str = name) -> RunMetrics:
            metrics = measure(
                fleet_of[policy_name], policy_of[policy_name], scenario.slo, draw(rate), rate, shape=False
            )
            if on_run is not None:
                on_run(policy_name, metrics)
            return metrics

        row = comparison_row(policy.name, throughput_at_slo(run_at, scenario.start_rps, target=scenario.slo_target))
        row["num_gpus"] = fleet.num_gpus
        row["usd_per_hour"] = sum(r.num_gpus * r.price for r in fleet.regions)
        row["workers"] = {
            r.name: {"prefill": r.num_prefill_workers, "decode": r.num_decode_workers} for r in fleet.regions
        }
        if tuned is not None:
            row["tuned"] = tuned
        rows.append(row)
    # TTFT compared at one rate (the lowest throughput at SLO): at its own rate at SLO each
    # policy's P90 sits near the objective by construction.
    common = min((row["throughput_at_slo_rps"] for row in rows), default=0.0)
    if common > 0:
        for row in rows:
            name = row["policy"]
            metrics = measure(fleet_of[name], policy_of[name], scenario.slo, draw(common), common, shape=False)
            row["common_rate_rps"] = common
            row["ttft_p90_at_common_rate_s"] = metrics.ttft_p90_s
            # unloaded: a tenth of that rate, where queues are rare (what the paper's TTFTs are)
            light = measure(fleet_of[name], policy_of[name], scenario.slo, draw(common / 10), common / 10, shape=False)
            row["light_rate_rps"] = common / 10
            row["ttft_mean_light_s"] = light.ttft_mean_s
            row["ttft_p90_light_s"] = light.ttft_p90_s
    return rows


def _share_of(point: PlanPoint) -> float:
    prefill = sum(point.prefill_workers.values())
    return prefill / (prefill + sum(point.decode_workers.values()))


# the figures every `--json` row carries (`experiment.comparison_row`), each a number or null; and those a row
# may carry, which the table and the chart read when they are there
ROW_FIGURES = ("throughput_at_slo_rps", "ttft_p90_s", "link_util", "usd_per_mtok")
OPTIONAL_FIGURES = ("ttft_p90_at_common_rate_s",)


def load_rows(path: str | Path) -> list[dict[str, Any]]:
    """Rows written by `prfaas sim run --json`; a clear error (naming the file) for anything else."""
    try:
        rows = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not JSON: {exc}") from None
    if not isinstance(rows, list) or not all(isinstance(r, dict) and isinstance(r.get("policy"), str) for r in rows):
        raise ValueError(f"{path} is not a `prfaas sim run --json` file (a list of rows with `policy`)")
    for row in rows:
        name = f"{path} is not a `prfaas sim run --json` file: policy {row['policy']!r}"
        for key in ROW_FIGURES + OPTIONAL_FIGURES:
            if key not in row:
                if key in ROW_FIGURES:
                    raise ValueError(f"{name} has no `{key}`")
            elif not _number_or_null(row[key]):
                raise ValueError(f"{name} has `{key}` {row[key]!r}, not a number or null")
        if not isinstance(row.get("at_slo") or {}, dict):
            raise ValueError(f"{name} has `at_slo` {row['at_slo']!r}, not an object")
    return rows


def _number_or_null(value: Any) -> bool:
    return value is None or (isinstance(value, int | float) and not isinstance(value, bool))


def paper_lines(scenario_name: str, rows: list[dict[str, Any]]) -> list[str]:
    """Our gains beside the scenario's published ones (nothing when it has none)."""
    paper = SCENARIOS[scenario_name]().paper
    by = {row["policy"]: row for row in rows}
    if paper is None or not {"prfaas", "homogeneous-pd", "naive-heterogeneous"} <= by.keys():
        return []
    ours, homo, naive = by["prfaas"], by["homogeneous-pd"], by["naive-heterogeneous"]
    lines = [
        "fleets: "
        + ", ".join(
            f"{row['policy']} {row.get('num_gpus', '?')} GPUs ${row.get('usd_per_hour', 0):.0f}/h"
            + (" (tuned split)" if row.get("tuned") else "")
            for row in rows
        )
    ]
    compared = [
        ("vs homogeneous PD (equal GPU count)", homo, "gain_vs_homogeneous"),
        ("vs naive heterogeneous", naive, "gain_vs_naive"),
    ]
    if "homogeneous-pd-equal-cost" in by:
        compared.insert(1, ("vs homogeneous PD (equal cost)", by["homogeneous-pd-equal-cost"], "gain_vs_equal_cost"))
    for label, base, key in compared:
        gain = (
            ours["throughput_at_slo_rps"] / base["throughput_at_slo_rps"] - 1 if base["throughput_at_slo_rps"] else None
        )
        lines.append(f"throughput at SLO {label}: sim {_pct(gain)}, paper {_pct(paper[key])}")
    if ours.get("ttft_p90_at_common_rate_s") and homo.get("ttft_p90_at_common_rate_s"):
        change = ours["ttft_p90_at_common_rate_s"] / homo["ttft_p90_at_common_rate_s"] - 1
        rate = ours["common_rate_rps"]
        lines.append(
            f"P90 TTFT vs homogeneous PD at {rate:.3g} req/s: sim {_pct(change)}, paper {_pct(-paper['p90_ttft_cut'])}"
        )
    if "prfaas_rps" in paper:
        lines.append("policy: req/s sim at SLO | paper (Λmax) ; TTFT mean / P90 s unloaded sim | paper")
        for name in ("prfaas", "homogeneous-pd", "naive-heterogeneous"):
            row = by[name]
            mean, p90 = row.get("ttft_mean_light_s"), row.get("ttft_p90_light_s")
            lines.append(
                f"  {name}: {row['throughput_at_slo_rps']:.2f} | {paper[name + '_rps']:.2f} ; "
                + (f"{mean:.2f} / {p90:.2f}" if mean is not None and p90 is not None else "n/a")
                + f" | {paper[name + '_ttft_mean_s']:.2f} / {paper[name + '_ttft_p90_s']:.2f}"
            )
        if ours.get("ttft_p90_light_s") and homo.get("ttft_p90_light_s"):
            cut = ours["ttft_p90_light_s"] / homo["ttft_p90_light_s"] - 1
            lines.append(f"P90 TTFT vs homogeneous PD, unloaded: sim {_pct(cut)}, paper {_pct(-paper['p90_ttft_cut'])}")
        lines.extend(analytic_lines(SCENARIOS[scenario_name]()))
    at = ours.get("at_slo") or {}
    gbps = sum(at.get("link_gbps", {}).values())
    raw = sum(at.get("link_raw_gbps", {}).values())
    lines.append(
        f"inter-DC link at prfaas's rate at SLO: sim {gbps:.1f} Gbps on the wire ({raw:.1f} Gbps of KV before "
        f"the codec), paper {paper['link_gbps']:.0f} Gbps of 100"
    )
    return lines


def analytic_lines(scenario: Scenario) -> list[str]:
    """The paper's own throughput model (`sim.analytic`) on the scenario's profiles and workload (a mix of
    request classes: the paper's model has no conversations)."""
    if not isinstance(scenario.workload, Workload):
        return []
    table = analytic.paper_table(
        scenario.fleet, homogeneous_fleet(scenario.fleet), decode_only_pd_fleet(scenario.fleet), scenario.workload
    )
    ours, homo, naive = table["prfaas"], table["homogeneous-pd"], table["naive-heterogeneous"]
    return [
        "the paper's throughput model (§3.4) on these profiles, each at its optimum: "
        f"prfaas {ours.lambda_max:.2f} req/s (t {ours.threshold}, {ours.prefill_workers}P:{ours.decode_workers}D), "
        f"homogeneous-pd {homo.lambda_max:.2f} ({homo.prefill_workers}P:{homo.decode_workers}D), "
        f"naive-heterogeneous {naive.lambda_max:.2f}: {_pct(ours.lambda_max / homo.lambda_max - 1)} / "
        f"{_pct(ours.lambda_max / naive.lambda_max - 1)}"
    ]


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value:+.0%}"


def write_json(path: str | Path, rows: list[dict[str, Any]]) -> None:
    Path(path).write_text(json.dumps(rows, indent=2) + "\n", encoding="utf-8")
