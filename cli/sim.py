"""`prfaas sim ...`: the fleet simulator's commands (thin: sim/ does the work)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import Progress, SpinnerColumn, TaskID, TextColumn, TimeElapsedColumn
from rich.table import Table

from prfaas.cli.outputs import OutputError, chart_file, output_file, write_failed

console = Console()

sim_app = typer.Typer(
    help="The fleet simulator: the live scheduler policies on a modelled fleet.", no_args_is_help=True
)


def _fail(message: str) -> typer.Exit:
    """Print one `error:` line (not wrapped at the terminal's width) -> the exit 2 to raise."""
    console.print(f"[red]error:[/red] {escape(message)}", highlight=False, soft_wrap=True)
    return typer.Exit(2)


def _outputs(json_path: Path | None, png: Path | None) -> Path | None:
    """Check --json and --png before the work (exit 2 naming the option); -> the chart file matplotlib will
    write (`--png NAME` without a suffix: NAME.png)."""
    try:
        if json_path is not None:
            output_file(json_path, "--json")
        return None if png is None else chart_file(png, "--png")
    except OutputError as exc:
        raise _fail(str(exc)) from None


@sim_app.command("scenarios")
def sim_scenarios() -> None:
    """List the built-in scenarios."""
    from prfaas.sim.scenarios import SCENARIOS

    table = Table("name", "GPUs", "requests", "description")
    for name, make in SCENARIOS.items():
        scenario = make()
        table.add_row(name, str(scenario.fleet.num_gpus), str(scenario.num_requests), scenario.description)
    console.print(table)


@sim_app.command("run")
def sim_run(
    scenario: str = typer.Option("prfaas-case-study", help="see `prfaas sim scenarios`"),
    policy: list[str] = typer.Option(
        [], "--policy", help="policies to compare (repeatable; default: prfaas and every baseline)"
    ),
    seed: int = typer.Option(0, help="workload seed (same seed, same result)"),
    requests: int | None = typer.Option(
        None, help="requests per run (default: the scenario's; with --trace: its first N arrivals, default all)"
    ),
    trace: Path | None = typer.Option(None, help="JSONL trace to replay instead of the scenario's workload"),
    tune: bool = typer.Option(False, help="each policy on its own best prefill:decode split (prfaas: and threshold)"),
    json_path: Path | None = typer.Option(None, "--json", help="write one row per policy here"),
    png: Path | None = typer.Option(None, help="write a PNG chart of the rows here"),
) -> None:
    """Throughput at SLO, TTFT, link use and $/1M tokens of each policy, side by side."""
    from prfaas.sim.compare import compare, paper_lines, write_json

    chart = _outputs(json_path, png)
    try:
        with sim_progress() as (progress, task):
            rows = compare(
                scenario,
                policies=policy or None,
                seed=seed,
                num_requests=requests,
                trace_path=str(trace) if trace else None,
                tune=tune,
                on_run=lambda name, m: progress.update(
                    task, advance=1, description=f"{name}: {m.rate_rps:.3g} req/s -> {m.slo_attainment:.0%} in SLO"
                ),
            )
    except ValueError as exc:
        raise _fail(str(exc)) from None
    _print_rows({"": rows})
    for line in paper_lines(scenario, rows):
        console.print(line)
    try:
        if json_path is not None:
            write_json(json_path, rows)
            console.print(f"wrote {json_path}")
        if chart is not None:
            from prfaas.sim.charts import policy_chart

            console.print(f"wrote {policy_chart({scenario: rows}, chart, title=scenario)}")
    except OSError as exc:  # gone or full since the check
        raise _fail(write_failed(chart or json_path, exc)) from None


@sim_app.command("compare")
def sim_compare(
    files: list[Path] = typer.Argument(..., help="`prfaas sim run --json` files to set side by side"),
    png: Path | None = typer.Option(None, help="write a grouped bar chart here"),
) -> None:
    """Saved runs side by side, one column group per file."""
    from prfaas.sim.compare import load_rows

    chart = _outputs(None, png)
    try:
        labels = [path.stem for path in files]
        if len(set(labels)) < len(labels):  # same names in different folders: the full paths
            labels = [str(path) for path in files]
        runs = {label: load_rows(path) for label, path in zip(labels, files, strict=True)}
    except ValueError as exc:
        raise _fail(str(exc)) from None
    _print_rows(runs)
    if chart is not None:
        from prfaas.sim.charts import policy_chart

        try:
            console.print(f"wrote {policy_chart(runs, chart)}")
        except OSError as exc:
            raise _fail(write_failed(chart, exc)) from None


@sim_app.command("plan")
def sim_plan(
    scenario: str = typer.Option("prfaas-case-study", help="see `prfaas sim scenarios`"),
    policy: str = typer.Option("prfaas", help="prfaas (threshold x split), homogeneous-pd[-equal-cost] (split)"),
    threshold: list[int] = typer.Option([], "--threshold", help="thresholds to try (repeatable; default: a grid)"),
    share: list[float] = typer.Option([], "--prefill-share", help="PD prefill shares to try (default: every split)"),
    seed: int = typer.Option(0, help="workload seed"),
    requests: int | None = typer.Option(
        None, help="requests per run (default: the scenario's; with --trace: its first N arrivals, default all)"
    ),
    trace: Path | None = typer.Option(None, help="JSONL trace to plan for instead of the scenario's workload"),
    json_path: Path | None = typer.Option(None, "--json", help="write every grid point here"),
    png: Path | None = typer.Option(None, help="write throughput against threshold here"),
) -> None:
    """Grid search over the disaggregation threshold and the PD clusters' prefill:decode split;
    prints every point and the recommended configuration."""
    import json

    from prfaas.sim.compare import arrivals_for, load_scenario, trace_arrivals
    from prfaas.sim.planner import plan, recommend, recommended_yaml

    chart = _outputs(json_path, png)
    try:
        chosen = load_scenario(scenario, requests)
        draw = arrivals_for(chosen, trace_arrivals(trace, requests) if trace else None, seed)
        table = Table("threshold", "prefill:decode workers", "req/s at SLO", "TTFT P90 s", "split share", "$/1M tok")
        with sim_progress() as (progress, task):

            def on_point(p: Any) -> None:
                split = ", ".join(f"{n} {w}:{p.decode_workers[n]}" for n, w in p.prefill_workers.items())
                progress.update(task, advance=1, description=f"threshold {p.threshold}, {split}")
                table.add_row(
                    "-" if p.threshold is None else str(p.threshold),
                    split,
                    f"{p.throughput_at_slo_rps:.3g}",
                    _fmt(p.ttft_p90_s, ".2f"),
                    _fmt(p.split_share, ".0%"),
                    _fmt(p.usd_per_mtok, ".3f"),
                )

            points = plan(
                chosen, draw, policy=policy, thresholds=threshold or None, shares=share or None, on_point=on_point
            )
    except ValueError as exc:
        raise _fail(str(exc)) from None
    console.print(table)
    best = recommend(points)
    console.print(f"recommended ({policy}, {best.throughput_at_slo_rps:.3g} req/s at SLO):")
    console.print(recommended_yaml(best), highlight=False, markup=False)
    try:
        if json_path is not None:
            json_path.write_text(json.dumps([p.as_row() for p in points], indent=2) + "\n", encoding="utf-8")
            console.print(f"wrote {json_path}")
        if chart is not None:
            from prfaas.sim.charts import plan_chart

            console.print(f"wrote {plan_chart([p.as_row() for p in points], chart, title=f'{scenario}: {policy}')}")
    except OSError as exc:  # gone or full since the check
        raise _fail(write_failed(chart or json_path, exc)) from None


@sim_app.command("calibrate")
def sim_calibrate(
    timings: Path = typer.Option(..., help="measured per-region timings (JSON; docs/simulator.md, Calibration)"),
    trace: Path = typer.Option(..., help="workload JSONL; rows with `ttft_s` are the measured figures"),
    json_path: Path | None = typer.Option(None, "--json", help="write the prediction here"),
) -> None:
    """Predict a bench run's TTFT from measured timings, beside what the trace measured."""
    import json

    from prfaas.sim.calibration import predict_trace

    _outputs(json_path, None)
    try:
        prediction = predict_trace(timings, trace)
    except (ValueError, OSError) as exc:
        raise _fail(str(exc)) from None
    for line in prediction.lines():
        console.print(line, highlight=False, markup=False)
    if not prediction.num_compared:  # every figure would be "-": say why instead of writing nulls
        raise _fail(
            f"no TTFT to predict: none of the {prediction.num_requests} requests completed in the simulation"
            + (" and has a measured ttft_s" if prediction.num_completed else "")
        )
    if json_path is not None:
        try:
            json_path.write_text(json.dumps(prediction.as_row(), indent=2, allow_nan=False) + "\n", encoding="utf-8")
        except OSError as exc:
            raise _fail(write_failed(json_path, exc)) from None


def _fmt(value: Any, spec: str, scale: float = 1.0) -> str:
    """A figure of a saved row as `spec` says; "-" for null (none measured) or anything not a number."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        return "-"
    return format(value * scale, spec)


@contextlib.contextmanager
def sim_progress() -> Iterator[tuple[Progress, TaskID]]:
    """A spinner with the number of simulated runs (the count of runs is not known ahead)."""
    with Progress(SpinnerColumn(), TextColumn("{task.completed} runs"), TextColumn("{task.description}"),
                  TimeElapsedColumn(), console=console, transient=True) as progress:  # fmt: skip
        yield progress, progress.add_task("simulating", total=None)


def _print_rows(runs: dict[str, list[dict[str, Any]]]) -> None:
    table = Table("run", "policy", "GPUs", "req/s at SLO", "TTFT P50/P90 s", "TPOT P90 ms", "link util", "$/1M tok",
                  "P90 TTFT at common rate s")  # fmt: skip
    for run, rows in runs.items():
        for row in rows:
            at = row.get("at_slo") or {}
            ttft = "-" if not at else f"{_fmt(at.get('ttft_p50_s'), '.2f')}/{_fmt(row['ttft_p90_s'], '.2f')}"
            table.add_row(
                run,
                row["policy"],
                str(row.get("num_gpus", "-")),
                _fmt(row["throughput_at_slo_rps"], ".3g"),
                ttft,
                _fmt(at.get("tpot_p90_s"), ".0f", 1000),
                _fmt(row["link_util"], ".1%"),
                _fmt(row["usd_per_mtok"], ".3f"),
                _fmt(row.get("ttft_p90_at_common_rate_s"), ".2f"),
            )
    console.print(table)
