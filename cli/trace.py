"""`prfaas trace JOB_ID`: where a job's time went, as the span tree of its trace (telemetry/tracing.py),
read from the span files of the deployment `prfaas up` runs ($PRFAAS_HOME/up/traces), or `--dir`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

if TYPE_CHECKING:
    from prfaas.telemetry.spans import SpanLine

console = Console()
MIN_PREFIX = 8  # the dashboard's recent jobs show a job id's first 8 characters


def _fail(message: str, code: int) -> typer.Exit:
    """Print one `error:` line (not wrapped at the console's width) -> the exit to raise."""
    console.print(f"[red]error:[/red] {escape(message)}", highlight=False, soft_wrap=True)
    return typer.Exit(code)


def trace(
    job_id: str = typer.Argument(
        ..., help="the job's id (the X-Prfaas-Job-Id header, or the response's id), or its first 8 or more characters"
    ),
    directory: Path | None = typer.Option(None, "--dir", help="span files' folder (default: `prfaas up`'s)"),
    as_json: bool = typer.Option(False, "--json", help="print the spans as JSON, parents before children"),
) -> None:
    """Print a job's span tree: each span's process, its start after the job's first span, its duration.
    Exit 1 when no span of the job is recorded, 2 when there is no span folder or the id's start given is
    that of several jobs."""
    from prfaas.engine.models import prfaas_home
    from prfaas.telemetry.spans import read_spans, tree
    from prfaas.telemetry.tracing import JOB_ID

    # `prfaas up`'s, and the run before it's (up.previous: an `up` keeps one run's spans)
    folders = [directory] if directory else [prfaas_home() / run / "traces" for run in ("up", "up.previous")]
    folder = folders[0]
    if not any(f.is_dir() for f in folders):
        raise _fail(f"no span files in {folder}: is `prfaas up` running (it records spans there), or were spans "
                    "exported elsewhere (OTLP)?", 2)  # fmt: skip
    recorded = [s for f in folders if f.is_dir() for s in read_spans(f)]  # as telemetry/spans.py's job_trace
    job_id = _full_id(job_id, {str(s.attributes[JOB_ID]) for s in recorded if JOB_ID in s.attributes})
    traces = {s.trace_id for s in recorded if s.attributes.get(JOB_ID) == job_id}
    spans = sorted((s for s in recorded if s.trace_id in traces), key=lambda s: s.start_ns)
    if not spans:
        raise _fail(f"no spans of job {job_id} in {folder} (a job's spans are written within a second of its end)", 1)
    if not as_json:
        console.print(trace_table(spans, f"job {job_id} (trace {spans[0].trace_id})"))
        return
    origin = spans[0].start_ns
    rows = [(depth, span) for root in tree(spans) for depth, span in root.walk()]
    print(json.dumps([{
        "depth": depth, "name": s.name, "service": s.service, "span_id": s.span_id, "parent_id": s.parent_id,
        "trace_id": s.trace_id, "start_ms": round((s.start_ns - origin) / 1e6, 3), "duration_ms": round(s.ms, 3),
        "status": s.status, "attributes": s.attributes,
    } for depth, s in rows], indent=2))  # fmt: skip


def _full_id(given: str, jobs: set[str]) -> str:
    """`given`, or the one recorded job id that starts with it (`MIN_PREFIX` characters or more: the dashboard's
    short ids); exit 2 naming them when several do."""
    if given in jobs or len(given) < MIN_PREFIX:
        return given
    found = sorted(job for job in jobs if job.startswith(given))
    if len(found) > 1:
        shown = ", ".join(found[:3]) + (", ..." if len(found) > 3 else "")
        raise _fail(f"{given} is the start of {len(found)} jobs' ids ({shown}): give more of it", 2)
    return found[0] if found else given


def trace_table(spans: list[SpanLine], title: str, skip: tuple[str, ...] = ()) -> Table:
    """The span tree of `spans` (one trace) as a table: name indented by depth, process, start after the
    trace's first span, duration, status; spans whose name starts with one of `skip` are left out."""
    from prfaas.telemetry.spans import tree

    origin = min(s.start_ns for s in spans)
    kept = [s for s in spans if not (skip and s.name.startswith(skip))]  # their children become roots
    table = Table("span", "process", "start ms", "ms", "status", title=title)
    for depth, s in (row for root in tree(kept) for row in root.walk()):
        table.add_row("  " * depth + s.name, s.service, f"{(s.start_ns - origin) / 1e6:9.2f}", f"{s.ms:9.2f}",
                      s.status if s.status == "ok" else f"[red]{escape(s.status)}[/red]")  # fmt: skip
    return table
