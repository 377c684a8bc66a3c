"""`prfaas tour` (`make demo`): what the product does, on the deployment `prfaas up` started.
Logic: devstack/tour.py (the completion pair, the fleet rows); the policy table is `prfaas bench`, the
fleet view the simulator's comparison (`prfaas sim run`)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

console = Console(width=max(Console().width, 150))
# The policy table: short chats beside long RAG prompts, each policy on the same requests.
BENCH_ARGS = ["--compare", "colocated,split-always,prfaas", "--mix", "chat-rag", "--concurrency", "4"]


def _fail(message: str) -> typer.Exit:
    """Print one `error:` line (not wrapped at the console's width) -> the exit 2 to raise."""
    console.print(f"[red]error:[/red] {escape(message)}", highlight=False, soft_wrap=True)
    return typer.Exit(2)


def _mb(n: int) -> str:
    return f"{n / 1e6:,.2f} MB"


def tour(
    num_requests: int = typer.Option(8, "--num-requests", "-n", min=1, help="requests per policy in the policy table"),
    max_tokens: int = typer.Option(48, help="tokens of the split-vs-local completion"),
    fleet: bool = typer.Option(True, help="the fleet-scale view from the simulator (about 20 s)"),
    fleet_requests: int = typer.Option(
        1500, min=100, help="requests per simulated run of the fleet view (the scenario's own: 3000, twice the time)"
    ),
    out: Path = typer.Option(None, help="folder for the policy table's bench.json (default $PRFAAS_HOME/bench/)"),
    json_path: Path = typer.Option(None, "--json", help="write the completions and the fleet rows here"),
    down_after: bool = typer.Option(False, "--down-after", hidden=True, help="the caller stops it next (make demo)"),
) -> None:
    """The first run's story on a running `prfaas up`: one real completion split and local
    (identical), three placement policies on one workload, then the fleet the simulator models."""
    from prfaas.cli.outputs import OutputError, out_and_json, write_failed
    from prfaas.devstack.state import UpError, read_state
    from prfaas.devstack.tour import SCENARIO, WHY_THEY_DIFFER, TourError, completion_pair, fleet_command
    from prfaas.engine.models import prfaas_home
    from prfaas.loadgen.client import ApiUnusable, fetch_models

    try:  # before part 1: a path that cannot be written would lose the tour's figures
        out_and_json(out, json_path)
    except OutputError as exc:
        raise _fail(str(exc)) from None
    try:
        state = read_state(prfaas_home())
    except UpError as exc:  # a corrupt up.json
        raise _fail(str(exc)) from None
    if state is None or not state.api_key:
        raise _fail("nothing is up: run `prfaas up --model smollm2-135m --detach` first (make demo does)")
    try:
        model = fetch_models(state.api_base, state.api_key)[0]
    except ApiUnusable as exc:
        raise _fail(str(exc)) from None
    report: dict[str, Any] = {"model": model}

    console.rule(f"1. One request, split across regions and local ({model}, greedy)")
    try:
        split, local = completion_pair(state.api_base, state.api_key, model, max_tokens=max_tokens)
    except TourError as exc:
        raise _fail(str(exc)) from None
    for c in (split, local):
        raw, wire = c.kv_bytes
        shipped = f"; KV {_mb(raw)} -> {_mb(wire)} on the wire ({raw / wire:.2f}x, {c.codec})" if raw and wire else ""
        console.print(f"[bold]{c.placement}[/bold] ({c.path}, {c.seconds:.1f} s{shipped}):", highlight=False)
        console.print(f"  {escape(c.text)}", highlight=False)
    identical = split.text == local.text
    console.print("[green]identical[/green]: split and local produced the same text" if identical
                  else "[red]DIFFERENT[/red]: split and local disagree")  # fmt: skip
    report["completions"] = [{"placement": c.placement, "text": c.text, "seconds": c.seconds, "path": c.path,
                              "bytes_raw": c.kv_bytes[0], "bytes_wire": c.kv_bytes[1], "codec": c.codec}
                             for c in (split, local)]  # fmt: skip
    report["identical"] = identical
    report["split_trace"] = _split_trace(prfaas_home() / "up" / "traces", split.job["id"])

    console.rule(f"2. One workload, three placement policies ({num_requests} requests each)")
    _bench([*BENCH_ARGS, "-n", str(num_requests), *(["--out", str(out)] if out else [])])

    if fleet:
        command = fleet_command(SCENARIO, fleet_requests)
        console.rule("3. The same scheduler on a modelled fleet")
        console.print(command, highlight=False)
        rows = _fleet(fleet_requests)
        console.print(WHY_THEY_DIFFER, highlight=False)
        report["fleet"] = {"command": command, "rows": rows}

    console.rule("Yours to explore")
    console.print(f"dashboard  {state.dashboard_url} (sign in with the API key)", highlight=False)
    console.print(f"API key    {state.api_key}", highlight=False)
    console.print(f"API base   {state.api_base} (any OpenAI client)", highlight=False)
    again = "`prfaas up --model smollm2-135m` brings it back with the same tenant, key and usage."
    console.print(f"`make demo` stops the deployment now; {again}" if down_after else
                  f"The deployment stays up: `prfaas down` stops it, and {again}", highlight=False)  # fmt: skip
    if json_path is not None:
        try:
            json_path.parent.mkdir(parents=True, exist_ok=True)
            json_path.write_text(json.dumps(report, indent=2) + "\n")
        except OSError as exc:  # gone or full since the check
            raise _fail(write_failed(json_path, exc)) from None
        console.print(f"wrote {json_path}")
    if not identical:
        raise typer.Exit(1)


def _split_trace(folder: Path, job_id: str, wait_s: float = 3.0) -> list[dict[str, Any]]:
    """Where the split completion's time went: its trace (telemetry/), once the decode region's span is
    written (each process flushes its spans within a fraction of a second); [] when no spans are recorded."""
    from prfaas.cli.trace import trace_table
    from prfaas.telemetry.spans import job_trace

    deadline, spans = time.monotonic() + wait_s, []
    while time.monotonic() < deadline:
        spans = job_trace(folder, job_id) if folder.is_dir() else []
        if any(s.name == "decode.job" for s in spans):
            break
        time.sleep(0.2)
    if not spans:
        return []
    console.print(trace_table(spans, "where the split request's time went (`prfaas trace JOB_ID`)",
                              skip=("fastapi.", "POST ")), highlight=False)  # fmt: skip
    origin = min(s.start_ns for s in spans)
    return [{"name": s.name, "service": s.service, "start_ms": round((s.start_ns - origin) / 1e6, 3),
             "ms": round(s.ms, 3)} for s in spans]  # fmt: skip


def _bench(args: list[str]) -> None:
    """`prfaas bench ARGS` in this process; its failure is the tour's."""
    import click

    from prfaas.cli.bench import bench

    app = typer.Typer(add_completion=False)
    app.command()(bench)
    try:
        code = typer.main.get_command(app).main(args=args, prog_name="prfaas bench", standalone_mode=False)
    except click.exceptions.Exit as exc:
        code = exc.exit_code
    except click.ClickException as exc:
        raise _fail(f"prfaas bench: {exc.format_message()}") from None
    if code not in (None, 0):
        raise _fail(f"prfaas bench {' '.join(args)} exited with status {code}")


def fleet_view(scenario: str, num_requests: int | None = None, on_run: Any = None) -> list[dict[str, Any]]:
    """`fleet_command(scenario, num_requests)`: prfaas and the two PD baselines, one row per policy
    (`num_requests` None: the scenario's own count)."""
    from prfaas.devstack.tour import FLEET_POLICIES
    from prfaas.sim.compare import compare

    return compare(scenario, policies=list(FLEET_POLICIES), num_requests=num_requests, on_run=on_run)


def _fleet(num_requests: int) -> list[dict[str, Any]]:
    from prfaas.cli.sim import sim_progress
    from prfaas.devstack.tour import SCENARIO, fleet_rows

    with sim_progress() as (bar, task):
        rows = fleet_view(
            SCENARIO,
            num_requests,
            on_run=lambda name, m: bar.update(
                task, advance=1, description=f"{name}: {m.rate_rps:.3g} req/s -> {m.slo_attainment:.0%} in SLO"
            ),
        )
    closing = fleet_rows(rows)
    table = Table(
        "policy",
        "GPUs",
        "$/h",
        "req/s at SLO",
        "prfaas / it",
        "P90 TTFT s",
        "prfaas / it",
        "$/1M tok",
        title="fleet-scale: throughput at the SLO, and P90 TTFT at a rate every policy sustains",
    )
    for row in closing:
        table.add_row(
            row["policy"], str(row["gpus"] or "-"), f"{row['usd_per_hour'] or 0:.0f}",
            f"{row['throughput_at_slo_rps']:.2f}",
            "-" if row["prfaas_throughput_x"] is None else f"{row['prfaas_throughput_x']:.2f}x",
            "-" if row["ttft_p90_s"] is None else f"{row['ttft_p90_s']:.2f}",
            "-" if row["prfaas_ttft_p90_x"] is None else f"{row['prfaas_ttft_p90_x']:.2f}x",
            "-" if row["usd_per_mtok"] is None else f"{row['usd_per_mtok']:.3f}",
        )  # fmt: skip
    console.print(table)
    return closing
