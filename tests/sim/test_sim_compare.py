"""`prfaas sim run`: the per-policy rows, trace replay, and the CLI's --json output."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from prfaas.cli.main import app
from prfaas.sim.compare import compare
from prfaas.sim.experiment import RunMetrics, throughput_at_slo
from prfaas.sim.workload import load_trace

REQUIRED = {"policy", "throughput_at_slo_rps", "ttft_p90_s", "link_util", "usd_per_mtok"}


def _fake(rate: float, attainment: float) -> RunMetrics:
    return RunMetrics(rate, 1, 1, 0, 0, attainment, 0, 0, 0, 0, 0, 0, 0, 1, {}, {}, 0.0, {}, 1.0, 0.0)


def test_search_finds_the_capacity_of_a_step_function() -> None:
    # attainment 1 below 3.0 req/s, 0 above: doubling from 1 brackets [2, 4], bisection narrows to within 4/2^6
    result = throughput_at_slo(lambda r: _fake(r, 1.0 if r <= 3.0 else 0.0), 1.0, steps=6)
    assert 3.0 - 2 / 2**6 <= result.throughput_at_slo_rps <= 3.0


def test_rows_have_the_required_keys_for_each_policy() -> None:
    rows = compare("small", num_requests=120)
    assert [row["policy"] for row in rows] == [
        "prfaas",
        "homogeneous-pd",
        "homogeneous-pd-equal-cost",
        "naive-heterogeneous",
    ]
    for row in rows:
        assert row.keys() >= REQUIRED
        assert row["throughput_at_slo_rps"] > 0


def test_trace_replay_reads_jsonl(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    lines = [{"t_s": i * 0.5, "prompt_tokens": 1000 + i, "output_tokens": 50} for i in range(40)]
    lines[3] = {"t_s": 1.5, "prompt_tokens": 1003, "max_new_tokens": 50, "cached_tokens": 500}
    trace.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    assert load_trace(trace)[3].cached_tokens == 500
    rows = compare("small", policies=["prfaas"], trace_path=str(trace))
    assert rows[0]["at_slo"]["num_requests"] == 40


def test_a_trace_replays_from_its_first_arrival(tmp_path: Path) -> None:
    # t_s in Unix seconds (or a window cut out of a longer log): replayed from 0 s with its gaps, so the simulated
    # clock stays where a float resolves a microsecond, and a run never waits an hour (or 54 years) for its first
    trace = tmp_path / "trace.jsonl"
    rows = [{"t_s": 1.7e9 + t, "prompt_tokens": 1000, "output_tokens": 50} for t in (2.5, 0.0, 1.25)]
    trace.write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert [a.at_s for a in load_trace(trace)] == [0.0, 1.25, 2.5]


def test_cli_writes_json_rows(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    result = CliRunner().invoke(app, ["sim", "run", "--scenario", "small", "--requests", "100", "--json", str(out)])
    assert result.exit_code == 0, result.output
    rows = json.loads(out.read_text())
    assert len(rows) == 4 and all(row.keys() >= REQUIRED for row in rows)


def test_cli_rejects_an_unknown_scenario() -> None:
    result = CliRunner().invoke(app, ["sim", "run", "--scenario", "nope"])
    assert result.exit_code == 2 and "unknown scenario" in result.output


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        ([], "holds no request"),
        (['{"t_s": NaN, "prompt_tokens": 10, "output_tokens": 5}'], "t_s >= 0 (finite)"),
        (['{"t_s": Infinity, "prompt_tokens": 10, "output_tokens": 5}'], "t_s >= 0 (finite)"),
        (['{"t_s": 0, "prompt_tokens": 0, "output_tokens": 5}'], "prompt_tokens >= 1"),
        (['{"t_s": 0, "prompt_tokens": 10, "output_tokens": -1}'], "output_tokens >= 1"),
        (['{"t_s": 0, "prompt_tokens": 10, "output_tokens": 5, "cached_tokens": 10}'], "cached_tokens must be"),
        (['{"t_s": 1, "prompt_tokens": 10, "output_tokens": 5}'] * 2, "arrivals at two times or more"),
    ],
)
def test_cli_refuses_a_trace_no_workload_could_be(tmp_path: Path, lines: list[str], message: str) -> None:
    """A clear error (exit 2), never a traceback or a figure from nothing (a NaN time read 0 req/s at SLO)."""
    trace = tmp_path / "trace.jsonl"
    trace.write_text("\n".join(lines) + "\n")
    result = CliRunner().invoke(app, ["sim", "run", "--policy", "prfaas", "--trace", str(trace)])
    assert result.exit_code == 2 and message in result.output, result.output


def test_cli_names_a_trace_it_cannot_read(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["sim", "run", "--policy", "prfaas", "--trace", str(tmp_path / "nope.jsonl")])
    assert result.exit_code == 2 and "cannot read the trace" in result.output, result.output


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        # a row with its policy only: KeyError 'throughput_at_slo_rps' out of the table, a traceback
        ([{"policy": "x"}], "policy 'x' has no `throughput_at_slo_rps`"),
        ([{"policy": "x", "throughput_at_slo_rps": "fast"}], "`throughput_at_slo_rps` 'fast', not a number or null"),
        ([{**dict.fromkeys(REQUIRED), "policy": "x", "at_slo": [1]}], "`at_slo` [1], not an object"),
    ],
)
def test_cli_compare_names_a_file_whose_rows_are_not_a_runs(tmp_path: Path, rows: list, message: str) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(rows))
    result = CliRunner().invoke(app, ["sim", "compare", str(bad)])
    assert result.exit_code == 2 and not isinstance(result.exception, KeyError | TypeError), result.output
    assert f"{bad} is not a `prfaas sim run --json` file" in result.output and message in result.output


def test_cli_compare_prints_null_figures_as_dashes(tmp_path: Path) -> None:
    # null is what a run with nothing at SLO writes (comparison_row: no run met it, or an infinite figure)
    run = tmp_path / "run.json"
    run.write_text(json.dumps([{**dict.fromkeys(REQUIRED), "policy": "x", "at_slo": {"ttft_p50_s": None}}]))
    result = CliRunner().invoke(app, ["sim", "compare", str(run)])
    assert result.exit_code == 0, result.output
    assert "│ x " in result.output and "│ - " in result.output


def _trace_of_40(tmp_path: Path) -> Path:
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps({"t_s": i * 0.5, "prompt_tokens": 900, "output_tokens": 20}) + "\n"
                             for i in range(40)))  # fmt: skip
    return trace


def test_requests_cut_a_trace_to_its_first_arrivals(tmp_path: Path) -> None:
    # --requests with --trace was ignored: every run replayed all 40 rows
    rows = compare("small", policies=["prfaas"], trace_path=str(_trace_of_40(tmp_path)), num_requests=10)
    assert rows[0]["at_slo"]["num_requests"] == 10


def test_cli_plan_cuts_a_trace_to_requests(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    trace = _trace_of_40(tmp_path)
    drawn: list[int] = []

    def fake_plan(scenario, draw, **kwargs):  # type: ignore[no-untyped-def]
        drawn.append(len(draw(1.0)))
        raise ValueError("planned")

    monkeypatch.setattr("prfaas.sim.planner.plan", fake_plan)
    result = CliRunner().invoke(app, ["sim", "plan", "--scenario", "small", "--trace", str(trace), "--requests", "7"])
    assert result.exit_code == 2 and "planned" in result.output and drawn == [7], result.output
