"""`prfaas sim plan`, the equal-GPU baselines, `--compare` and the PNG charts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from prfaas.cli.main import app
from prfaas.sim.compare import arrivals_for, load_scenario
from prfaas.sim.planner import PlanPoint, plan, recommend, recommended_yaml, split_shares, with_split
from prfaas.sim.policies import decode_only_pd_fleet, homogeneous_fleet
from prfaas.sim.scenarios import case_study

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_homogeneous_baseline_has_the_same_gpu_count_all_of_the_pd_clusters_type() -> None:
    fleet = case_study().fleet  # 32 H200 (4 instances x 8) + 64 H20 (3 prefill + 5 decode instances x 8)
    same = homogeneous_fleet(fleet)
    assert same.num_gpus == fleet.num_gpus == 96
    [pd] = same.regions
    # 12 H20 instances split in the PD cluster's own 3:5 ratio (4.5 rounds to 4)
    assert pd.gpu == "H20" and (pd.num_prefill_workers, pd.num_decode_workers) == (4, 8) and not same.links


def test_naive_baseline_turns_the_pd_prefill_workers_into_decode_workers() -> None:
    fleet = decode_only_pd_fleet(case_study().fleet)
    assert fleet.num_gpus == 96
    assert [(r.num_prefill_workers, r.num_decode_workers) for r in fleet.regions] == [(4, 0), (0, 8)]


def test_splits_keep_each_pd_cluster_whole() -> None:
    fleet = case_study().fleet
    assert split_shares(fleet) == [k / 8 for k in range(1, 8)]
    assert [(r.num_prefill_workers, r.num_decode_workers) for r in with_split(fleet, 0.75).regions] == [(4, 0), (6, 2)]


def _point(rps: float, usd: float | None, threshold: int = 0) -> PlanPoint:
    return PlanPoint(threshold, {"pd": 1}, {"pd": 1}, rps, 1.0, usd, 0.5)


def test_recommend_takes_the_best_throughput_and_breaks_near_ties_on_cost() -> None:
    # 10.0 and 9.9 are within 2%: the cheaper one wins; 8.0 is out of the tie band though cheapest
    points = [_point(10.0, 1.0, 1), _point(9.9, 0.5, 2), _point(8.0, 0.1, 3)]
    assert recommend(points).threshold == 2
    assert "min_uncached_tokens: 2" in recommended_yaml(recommend(points))


def test_plan_covers_the_grid_and_a_never_splitting_threshold_splits_nothing() -> None:
    scenario = load_scenario("small", 80)
    points = plan(scenario, arrivals_for(scenario, None, 0), thresholds=[0, 10**9], shares=[0.5])
    assert [p.threshold for p in points] == [0, 10**9]
    assert points[1].split_share == 0.0 and (points[0].split_share or 0) > 0
    assert all(p.throughput_at_slo_rps > 0 for p in points)


def test_plan_refuses_the_naive_policy() -> None:
    scenario = load_scenario("small", 50)
    with pytest.raises(ValueError, match="naive-heterogeneous"):
        plan(scenario, arrivals_for(scenario, None, 0), policy="naive-heterogeneous")


def test_cli_plan_prints_a_recommendation_and_writes_json_and_png(tmp_path: Path) -> None:
    out, png = tmp_path / "plan.json", tmp_path / "plan.png"
    args = ["sim", "plan", "--scenario", "small", "--requests", "60", "--threshold", "0", "--threshold", "4096"]
    result = CliRunner().invoke(app, [*args, "--json", str(out), "--png", str(png)])
    assert result.exit_code == 0, result.output
    assert "recommended" in result.output and "min_uncached_tokens" in result.output
    assert len(json.loads(out.read_text())) == 2 * len(split_shares(load_scenario("small").fleet))
    assert png.read_bytes().startswith(PNG_MAGIC)


def test_cli_compare_sets_saved_runs_side_by_side(tmp_path: Path) -> None:
    runner = CliRunner()
    for seed in (1, 2):
        args = ["sim", "run", "--scenario", "small", "--requests", "60", "--seed", str(seed), "--policy", "prfaas"]
        result = runner.invoke(app, [*args, "--json", str(tmp_path / f"s{seed}.json")])
        assert result.exit_code == 0, result.output
    png = tmp_path / "cmp.png"
    result = runner.invoke(
        app, ["sim", "compare", str(tmp_path / "s1.json"), str(tmp_path / "s2.json"), "--png", str(png)]
    )
    assert result.exit_code == 0, result.output
    assert "s1" in result.output and "s2" in result.output
    assert png.read_bytes().startswith(PNG_MAGIC)


def test_cli_compare_rejects_a_file_that_is_not_a_run(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"policy": "x"}')
    result = CliRunner().invoke(app, ["sim", "compare", str(bad)])
    assert result.exit_code == 2 and "not a `prfaas sim run --json` file" in result.output
