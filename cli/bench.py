"""`prfaas bench`: drive a running deployment (default: the one `prfaas up` wrote to
$PRFAAS_HOME/up.json) with a workload and report TTFT, TPOT, ITL, E2E percentiles,
throughput, goodput at SLO and $ per 1M tokens; `--compare` runs the same workload under
several placement policies and prints ratios. Logic: bench/workload.py, loadgen.py, report.py."""

from __future__ import annotations

import inspect
import json
import time
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

console = Console(width=max(Console().width, 150))  # the tables are wide; pipes get 80 columns


def _fail(message: str) -> typer.Exit:
    console.print(f"[red]error:[/red] {escape(message)}", highlight=False)
    return typer.Exit(2)


def prompt_corpus(model: str) -> tuple[list[int], int]:
    """Real English and Python source as the model's token ids, and its context length."""
    import argparse
    import ast
    import typing

    from tokenizers import Tokenizer

    from prfaas.engine.errors import EngineError
    from prfaas.engine.models import resolve_model

    try:
        folder = Path(resolve_model(model))
    except EngineError as exc:
        raise _fail(f"cannot tokenize for {model!r}: {exc}") from None
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    text = "\n".join(inspect.getsource(m) for m in (argparse, ast, typing))
    config = json.loads((folder / "config.json").read_text())
    return list(tokenizer.encode(text, add_special_tokens=False).ids), int(config.get("max_position_embeddings", 2048))


def _connection(api_base: str | None, api_key: str | None) -> tuple[str, str]:
    from prfaas.cli.up_state import read_state
    from prfaas.engine.models import prfaas_home

    if api_base and api_key:
        return api_base.rstrip("/"), api_key
    state = read_state(prfaas_home())
    if state is None or not state.api_key:
        raise _fail("no deployment to bench: run `prfaas up` first, or pass --api-base and --api-key")
    return (api_base or state.api_base).rstrip("/"), api_key or state.api_key


def _ms(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{1e3 * value:.{digits}f}"


def _table(summaries: dict[str, dict[str, Any]]) -> Table:
    table = Table("policy", "ok/fail", "TTFT P50", "P90", "P99", "TPOT P50", "ITL P50", "E2E P50", "P90",
                  "req/s", "out tok/s", "goodput req/s", "split", "$/1M tok", title="latencies in ms")  # fmt: skip
    for policy, s in summaries.items():
        split = s["placements"].get("split", 0) / max(1, s["completed"])
        cost = s["cost"]
        table.add_row(
            policy, f"{s['completed']}/{s['failed']}", _ms(s["ttft_s"]["p50"]), _ms(s["ttft_s"]["p90"]),
            _ms(s["ttft_s"]["p99"]), _ms(s["tpot_s"]["p50"], 1), _ms(s["itl_s"]["p50"], 1), _ms(s["e2e_s"]["p50"]),
            _ms(s["e2e_s"]["p90"]), f"{s['throughput']['requests_per_s']:.2f}",
            f"{s['throughput']['output_tokens_per_s']:.1f}", f"{s['goodput']['requests_per_s']:.2f}", f"{split:.0%}",
            "-" if cost is None else f"{cost['usd_per_1m_tokens']:.4f}",
        )  # fmt: skip
    return table


def bench(
    api_base: str = typer.Option(None, help="OpenAI base URL (default: from $PRFAAS_HOME/up.json)"),
    api_key: str = typer.Option(None, envvar="PRFAAS_API_KEY", help="tenant API key (default: up.json)"),
    model: str = typer.Option(None, help="model name (default: the one GET /v1/models serves)"),
    num_requests: int = typer.Option(40, "--num-requests", "-n", help="requests per policy"),
    rate: float = typer.Option(None, help="open loop: requests/s (gamma arrivals, see --burstiness)"),
    concurrency: int = typer.Option(None, help="closed loop: requests in flight (default 4 when no --rate)"),
    burstiness: float = typer.Option(1.0, help="CV of inter-arrival gaps: 1 Poisson, >1 bursty gamma"),
    input_len: str = typer.Option("fixed:256", help="fixed:N | uniform:LO-HI | lognormal:MEDIAN,SIGMA"),
    output_len: str = typer.Option("fixed:16", help="same forms as --input-len"),
    mix: str = typer.Option(None, help="named mix instead of the lengths: chat-rag | chat-agent"),
    shared_prefix: int = typer.Option(0, help="tokens of prefix shared within a group"),
    prefix_groups: int = typer.Option(1, help="distinct shared prefixes"),
    seed: int = typer.Option(0),
    policy: str = typer.Option("prfaas", help="colocated | split-always | prfaas"),
    compare: str = typer.Option(
        None, help="comma list of policies run on the same workload (ratios are to the first)"
    ),
    slo_ttft_ms: float = typer.Option(2000.0, help="goodput: TTFT target"),
    slo_tpot_ms: float = typer.Option(200.0, help="goodput: TPOT target"),
    warmup: int = typer.Option(2, help="short local and split requests each, sent first (not counted)"),
    timeout_s: float = typer.Option(300.0, help="deadline of each request"),
    out: Path = typer.Option(None, help="folder for bench.json, bench.png, trace.jsonl (default $PRFAAS_HOME/bench/)"),
) -> None:  # fmt: skip
    """Load-test a deployment through the OpenAI API (streaming) and report latency percentiles,
    throughput, goodput at SLO and cost; `--compare` runs each policy on the same workload."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    try:
        from prfaas.bench import loadgen, report
        from prfaas.bench.workload import WorkloadError, WorkloadSpec, plan
    except ImportError as exc:
        raise _fail(f"{exc.name} is missing: pip install 'prfaas[bench]' (openai, matplotlib)") from None

    policies = [p.strip() for p in (compare or policy).split(",") if p.strip()]
    unknown = [p for p in policies if p not in loadgen.PLACEMENTS]
    if unknown or not policies:
        raise _fail(f"unknown policy {', '.join(unknown) or '(none)'}; known: {', '.join(loadgen.PLACEMENTS)}")
    if rate is not None and concurrency is not None:
        raise _fail("--rate (open loop) and --concurrency (closed loop) exclude each other")
    if concurrency is not None and concurrency < 1:
        raise _fail("--concurrency: at least 1")
    if rate is None and concurrency is None:
        concurrency = 4
    spec = WorkloadSpec(num_requests, rate, burstiness, input_len, output_len, mix, shared_prefix, prefix_groups, seed)
    try:
        spec.validate()
    except WorkloadError as exc:
        raise _fail(str(exc)) from None
    base, key = _connection(api_base, api_key)
    try:
        served = model or loadgen.fetch_models(base, key)[0]
    except Exception as exc:
        raise _fail(f"cannot reach {base}/models: {exc}") from None
    corpus, context = prompt_corpus(served)
    try:
        requests = plan(spec, corpus, max_prompt_tokens=context // 2)
        warm = plan(WorkloadSpec(max(1, warmup), None, seed=seed + 1, input_len="fixed:64", output_len="fixed:4"),
                    corpus, context // 2)  # fmt: skip
    except WorkloadError as exc:
        raise _fail(str(exc)) from None
    folder = out or Path(_home()) / "bench" / time.strftime("%Y%m%d-%H%M%S")
    folder.mkdir(parents=True, exist_ok=True)
    summaries: dict[str, dict[str, Any]] = {}
    rows: list[dict[str, Any]] = []
    loop = f"rate {rate} req/s (burstiness {burstiness})" if rate is not None else f"concurrency {concurrency}"
    console.print(f"{served} at {base}: {num_requests} requests/policy, {loop}, "
                  f"{'mix ' + mix if mix else f'input {input_len}, output {output_len}'}")  # fmt: skip
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console) as progress:  # fmt: skip
        for placement in ("local", "split") if warmup else ():  # both paths warm before any policy runs
            loadgen.run(base, key, served, warm, placement, concurrency=1, timeout_s=timeout_s)
        for name in policies:
            placement = loadgen.PLACEMENTS[name]
            task = progress.add_task(name, total=len(requests))
            outcomes, wall_s = loadgen.run(base, key, served, requests, placement, concurrency, timeout_s,
                                           on_done=lambda _o, t=task: progress.advance(t))  # fmt: skip
            loadgen.attach_jobs(base, key, outcomes)
            summaries[name] = report.summarize(outcomes, wall_s, slo_ttft_ms / 1e3, slo_tpot_ms / 1e3)
            rows += report.trace_rows(name, outcomes)
    console.print(_table(summaries))
    result: dict[str, Any] = {
        "api_base": base, "model": served, "policies": summaries, "baseline": policies[0],
        "workload": {"num_requests": num_requests, "rate_rps": rate, "concurrency": concurrency,
                     "burstiness": burstiness, "input_len": input_len, "output_len": output_len, "mix": mix,
                     "shared_prefix_tokens": shared_prefix, "prefix_groups": prefix_groups, "seed": seed},
    }  # fmt: skip
    if len(policies) > 1:
        result["ratios"] = report.ratios(summaries, policies[0])
        ratio_table = Table("policy", *(label for label, _, _ in report.RATIO_KEYS), title=f"ratio to {policies[0]}")
        for name, row in result["ratios"].items():
            ratio_table.add_row(name, *("-" if v is None else f"{v:.2f}x" for v in row.values()))
        console.print(ratio_table)
    (folder / "bench.json").write_text(json.dumps(result, indent=2) + "\n")
    report.write_trace(folder / "trace.jsonl", rows)
    report.plot(folder / "bench.png", summaries, f"{served}: {loop}")
    console.print(f"wrote {folder / 'bench.json'}, {folder / 'bench.png'}, {folder / 'trace.jsonl'}")
    failed = sum(s["failed"] for s in summaries.values())
    if failed:
        console.print(f"[yellow]{failed} requests failed[/yellow]: {escape('; '.join(_errors(summaries)))}")
    if any(s["completed"] == 0 for s in summaries.values()):
        raise typer.Exit(1)  # nothing to compare: make demo must fail


def _errors(summaries: dict[str, dict[str, Any]]) -> list[str]:
    return sorted({e for s in summaries.values() for e in s["errors"]})[:3]


def _home() -> Path:
    from prfaas.engine.models import prfaas_home

    return prfaas_home()
