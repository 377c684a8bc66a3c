"""`prfaas bench`: drive a running deployment (default: the one `prfaas up` wrote to
$PRFAAS_HOME/up.json) with a workload and report TTFT, TPOT, ITL, E2E percentiles,
throughput, goodput at SLO and $ per 1M tokens; `--compare` runs the same workload under
several placement policies and prints ratios. Logic: the loadgen package (workload.py, client.py, report.py)."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from prfaas.cli.outputs import OutputError, out_and_json, write_failed
from prfaas.loadgen.workload import MAX_DURATION_S  # stdlib only: no bench extra needed

console = Console(width=max(Console().width, 150))  # the tables are wide; pipes get 80 columns


def _fail(message: str) -> typer.Exit:
    """Print one `error:` line (not wrapped at the console's width) -> the exit 2 to raise."""
    console.print(f"[red]error:[/red] {escape(message)}", highlight=False, soft_wrap=True)
    return typer.Exit(2)


def _connection(api_base: str | None, api_key: str | None) -> tuple[str, str]:
    from prfaas.devstack.state import UpError, read_state
    from prfaas.engine.models import prfaas_home

    if api_base and api_key:
        return api_base.rstrip("/"), api_key
    try:
        state = read_state(prfaas_home())
    except UpError as exc:  # a corrupt up.json
        raise _fail(str(exc)) from None
    if state is None or not state.api_key:
        raise _fail("no deployment to bench: run `prfaas up` first, or pass --api-base and --api-key")
    return (api_base or state.api_base).rstrip("/"), api_key or state.api_key


def _ms(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{1e3 * value:.{digits}f}"


def _table(summaries: dict[str, dict[str, Any]]) -> Table:
    table = Table("policy", "ok/fail", "TTFT P50", "P90", "P99", "TPOT P50", "ITL P50", "E2E P50", "P90",
                  "req/s", "out tok/s", "goodput req/s", "split", "$/1M tok", "prefill tok", "same text",
                  title="latencies in ms")  # fmt: skip
    for policy, s in summaries.items():
        split = s["placements"].get("split", 0) / max(1, s["completed"])
        cost = s["cost"]
        table.add_row(
            policy, f"{s['completed']}/{s['failed']}", _ms(s["ttft_s"]["p50"]), _ms(s["ttft_s"]["p90"]),
            _ms(s["ttft_s"]["p99"]), _ms(s["tpot_s"]["p50"], 1), _ms(s["itl_s"]["p50"], 1), _ms(s["e2e_s"]["p50"]),
            _ms(s["e2e_s"]["p90"]), f"{s['throughput']['requests_per_s']:.2f}",
            f"{s['throughput']['output_tokens_per_s']:.1f}", f"{s['goodput']['requests_per_s']:.2f}", f"{split:.0%}",
            "-" if cost is None else f"{cost['usd_per_1m_tokens']:.4f}", str(s["prefill_tokens_computed"]),
            "-" if s.get("identical_outputs") is None else f"{s['identical_outputs']}/{s['completed']}",
        )  # fmt: skip
    return table


def ratio_table(result: dict[str, Any]) -> Table:
    """bench.json's `ratios` (each policy's figures over the baseline's), after each policy's completed/failed
    requests: the percentiles are of the completed ones only, so a policy that fails more can look faster."""
    ratios: dict[str, dict[str, float | None]] = result["ratios"]
    table = Table("policy", "ok/fail", *next(iter(ratios.values())), title=f"ratio to {result['baseline']}")
    for name, row in ratios.items():
        s = result["policies"][name]
        figures = ("-" if v is None else f"{v:.2f}x" for v in row.values())
        table.add_row(name, f"{s['completed']}/{s['failed']}", *figures)
    return table


def shipped_lines(summaries: dict[str, dict[str, Any]]) -> list[str]:
    """Per policy: the KV it shipped (raw -> wire, the codec's ratio) and its cost against
    every request run colocated (the jobs' own counterfactual)."""
    lines = []
    for policy, s in summaries.items():
        kv, cost, codecs = s["kv_bytes"], s["cost"], s.get("codecs") or {}
        shipped = s["placements"].get("split", 0)
        text = f"{policy}: {shipped} of {s['completed']} requests split"
        if kv["raw"]:
            ratio = kv["raw"] / kv["wire"] if kv["wire"] else float("inf")
            used = ", ".join(f"{name} x{n}" for name, n in sorted(codecs.items())) or "codec unknown"
            text += f"; KV {kv['raw'] / 1e6:,.1f} MB raw -> {kv['wire'] / 1e6:,.1f} MB on the wire"
            text += f" ({ratio:.2f}x, {used})"
        if cost and cost["colocated_usd"]:
            saved = 1 - cost["usd"] / cost["colocated_usd"]
            text += f"; ${cost['usd']:.4f} against ${cost['colocated_usd']:.4f} all colocated "
            same = abs(saved) < 0.005
            text += "(the same)" if same else f"({saved:.0%} saved)" if saved > 0 else f"({-saved:.0%} more)"
        lines.append(text)
    return lines


def bench(
    api_base: str = typer.Option(None, help="OpenAI base URL (default: from $PRFAAS_HOME/up.json)"),
    api_key: str = typer.Option(None, envvar="PRFAAS_API_KEY", help="tenant API key (default: up.json)"),
    model: str = typer.Option(None, help="model name (default: the one GET /v1/models serves)"),
    num_requests: int = typer.Option(40, "--num-requests", "-n", help="requests per policy"),
    rate: float = typer.Option(
        None, help="open loop: requests/s (gamma arrivals, see --burstiness; multiturn: R / --turns conversations/s)"
    ),
    concurrency: int = typer.Option(None, help="closed loop: requests in flight (default 4 when no --rate)"),
    burstiness: float = typer.Option(1.0, help="CV of inter-arrival gaps: 1 Poisson, >1 bursty gamma"),
    max_duration_s: float = typer.Option(
        MAX_DURATION_S, help="open loop: refuse a plan whose last arrival (multiturn: conversation start) is later, s"
    ),
    input_len: str = typer.Option("fixed:256", help="fixed:N | uniform:LO-HI | lognormal:MEDIAN,SIGMA"),
    output_len: str = typer.Option("fixed:16", help="same forms as --input-len"),
    mix: str = typer.Option(None, help="named mix instead of the lengths: chat-rag | chat-agent | multiturn"),
    turns: int = typer.Option(4, help="multiturn: turns per conversation (each re-sends the conversation)"),
    think_s: float = typer.Option(1.0, help="multiturn: a user's pause between a reply and the next turn"),
    shared_prefix: int = typer.Option(0, help="tokens of prefix shared within a group (multiturn: the system prompt)"),
    prefix_groups: int = typer.Option(1, help="distinct shared prefixes"),
    seed: int = typer.Option(0),
    policy: str = typer.Option(
        "prfaas", help="colocated | split-always | prfaas | prfaas-prefix-blind | prfaas-residency-blind"
    ),
    compare: str = typer.Option(
        None, help="comma list of policies run on the same workload (ratios are to the first)"
    ),
    slo_ttft_ms: float = typer.Option(2000.0, help="goodput: TTFT target"),
    slo_tpot_ms: float = typer.Option(200.0, help="goodput: TPOT target"),
    warmup: int = typer.Option(2, min=0, help="short local and split requests each, sent first (not counted)"),
    timeout_s: float = typer.Option(300.0, min=1.0, help="deadline of each request, seconds"),
    out: Path = typer.Option(None, help="folder for bench.json, bench.png, trace.jsonl (default $PRFAAS_HOME/bench/)"),
    json_path: Path = typer.Option(None, "--json", help="also write bench.json's content to this file"),
) -> None:  # fmt: skip
    """Load-test a deployment through the OpenAI API (streaming) and report latency percentiles,
    throughput, goodput at SLO and cost; `--compare` runs each policy on the same workload."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    try:
        from prfaas.loadgen import bench as session
        from prfaas.loadgen import client as loadgen
        from prfaas.loadgen.conversations import CONVERSATIONAL, plan_conversations
        from prfaas.loadgen.workload import WorkloadError, WorkloadSpec, plan
    except ImportError as exc:
        raise _fail(f"{exc.name} is missing: pip install 'prfaas[bench]' (openai, matplotlib)") from None
    from prfaas.engine.errors import EngineError

    policies = [p.strip() for p in (compare or policy).split(",") if p.strip()]
    unknown = [p for p in policies if p not in loadgen.PLACEMENTS]
    if unknown or not policies:
        raise _fail(f"unknown policy {', '.join(unknown) or '(none)'}; known: {', '.join(loadgen.PLACEMENTS)}")
    twice = sorted({p for p in policies if policies.count(p) > 1})
    if twice:  # bench.json keys its figures by policy: a second run would overwrite the first's
        raise _fail(f"--compare: {', '.join(twice)} named more than once; each policy runs once")
    if rate is not None and concurrency is not None:
        raise _fail("--rate (open loop) and --concurrency (closed loop) exclude each other")
    if concurrency is not None and concurrency < 1:
        raise _fail("--concurrency: at least 1")
    if rate is None and concurrency is None:
        concurrency = 4
    if not math.isfinite(timeout_s) or not math.isfinite(think_s):  # nan passes typer's min: it compares False
        raise _fail("--timeout-s and --think-s: finite numbers of seconds")
    for option, target in (("--slo-ttft-ms", slo_ttft_ms), ("--slo-tpot-ms", slo_tpot_ms)):
        if not (math.isfinite(target) and target > 0):  # nan made bench.json invalid JSON; <= 0 no request is good
            raise _fail(f"{option}: a target must be a positive number of milliseconds, not {target}")
    try:  # before the run: a path that cannot be written would lose it
        out_and_json(out, json_path)
    except OutputError as exc:
        raise _fail(str(exc)) from None
    spec = WorkloadSpec(num_requests, rate, burstiness, input_len, output_len, mix, shared_prefix, prefix_groups, seed,
                        max_duration_s)  # fmt: skip
    try:
        spec.validate()
    except WorkloadError as exc:
        raise _fail(str(exc)) from None
    base, key = _connection(api_base, api_key)
    try:
        served = model or loadgen.fetch_models(base, key)[0]
    except loadgen.ApiUnusable as exc:
        raise _fail(str(exc)) from None
    try:
        corpus, context = session.corpus(served)
    except EngineError as exc:
        raise _fail(f"cannot tokenize for {served!r}: {exc}") from None
    if think_s < 0:
        raise _fail("--think-s: a pause is not negative")
    try:
        if mix in CONVERSATIONAL:
            conversations = plan_conversations(spec, corpus, context // 2, turns)
            send = _conversations(base, key, served, conversations, concurrency, timeout_s, context // 2, think_s)
        else:
            send = session.planned(base, key, served, plan(spec, corpus, context // 2), concurrency, timeout_s)
        warm = plan(WorkloadSpec(max(1, warmup), None, seed=seed + 1, input_len="fixed:64", output_len="fixed:4"),
                    corpus, context // 2) if warmup else []  # fmt: skip
    except WorkloadError as exc:
        raise _fail(str(exc)) from None
    loop = f"rate {rate} req/s (burstiness {burstiness})" if rate is not None else f"concurrency {concurrency}"
    console.print(f"{served} at {base}: {num_requests} requests/policy, {loop}, "
                  f"{'mix ' + mix if mix else f'input {input_len}, output {output_len}'}")  # fmt: skip
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, disable=not console.is_terminal) as bar:  # fmt: skip

        def progress(name: str, total: int) -> Callable[[], None]:
            task = bar.add_task(name, total=total)
            if console.is_terminal:
                return lambda: bar.advance(task)
            return _policy_line(name, total, lambda: bar.advance(task))

        try:
            summaries, rows = session.run(base, key, served, send, num_requests, warm, policies, timeout_s,
                                          (slo_ttft_ms / 1e3, slo_tpot_ms / 1e3), progress)  # fmt: skip
            interrupted = False
        except session.Interrupted as stop:  # Ctrl-C: keep what the finished policies measured
            summaries, rows, interrupted = stop.summaries, stop.rows, True
    if not summaries:
        console.print("[yellow]interrupted[/yellow] before any policy finished: nothing written")
        raise typer.Exit(130)
    console.print(_table(summaries))
    for line in shipped_lines(summaries):
        console.print(line, highlight=False)
    result = session.result(base, served, spec, concurrency, summaries, interrupted)
    if "ratios" in result:
        console.print(ratio_table(result))
    folder = out or Path(_home()) / "bench" / time.strftime("%Y%m%d-%H%M%S")
    try:
        paths = session.write(folder, result, rows, f"{served}: {loop}")
        if json_path is not None:
            json_path.parent.mkdir(parents=True, exist_ok=True)
            json_path.write_text(paths[0].read_text())
            paths.append(json_path)
    except OSError as exc:  # gone or full since the check
        raise _fail(write_failed(folder, exc)) from None
    console.print(f"wrote {', '.join(str(p) for p in paths)}")
    failed = sum(s["failed"] for s in summaries.values())
    if failed:
        console.print(f"[yellow]{failed} requests failed[/yellow]: {escape('; '.join(_errors(summaries)))}")
    if interrupted:
        console.print(f"[yellow]interrupted[/yellow]: {len(summaries)} of {len(policies)} policies finished "
                      f"({', '.join(summaries)}), their figures written")  # fmt: skip
        raise typer.Exit(130)
    if any(s["completed"] == 0 for s in summaries.values()):
        raise typer.Exit(1)  # nothing to compare: make demo must fail


def _policy_line(name: str, total: int, advance: Callable[[], None]) -> Callable[[], None]:
    """`advance`, and a line once the policy's `total` requests have ended: off a terminal (a log, `make demo`
    piped) the bar does not show, and three policies are minutes without a line otherwise."""
    started, ended, lock = time.monotonic(), [0], threading.Lock()

    def done() -> None:
        advance()
        with lock:  # requests end on the client's threads
            ended[0] += 1
            if ended[0] == total:
                console.print(f"{name}: {total}/{total} done ({time.monotonic() - started:.0f} s)", highlight=False)

    return done


def _conversations(base: str, key: str, model: str, conversations: list[Any], concurrency: int | None,
                   timeout_s: float, max_prompt: int, think_s: float) -> Any:  # fmt: skip
    """`loadgen.bench.Send` of conversations: each turn re-sends the conversation, replies tokenized again."""
    from prfaas.loadgen import bench as session
    from prfaas.loadgen import client as loadgen

    encode = session.tokenizer(model)
    return lambda placement, salt, on_done: loadgen.run_conversations(
        base, key, model, conversations, placement, concurrency, timeout_s, encode, max_prompt, think_s, on_done, salt
    )


def _errors(summaries: dict[str, dict[str, Any]]) -> list[str]:
    return sorted({e for s in summaries.values() for e in s["errors"]})[:3]


def _home() -> Path:
    from prfaas.engine.models import prfaas_home

    return prfaas_home()
