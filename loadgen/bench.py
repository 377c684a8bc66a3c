"""A `prfaas bench` run: the same workload under each placement policy, side by side.

`corpus(model)` gives real text as the model's tokens; `run(...)` warms both paths, sends the
workload once per policy (`Send`: planned requests, or conversations) and returns each policy's
figures (report.summarize, with how many replies equal the same request's under the other
policy) and the per-request trace (Ctrl-C: `Interrupted`, holding those of the policies that
finished); `result(...)` is the JSON `bench.json` holds; `write(...)` writes it with the trace and
the chart. Presentation (tables, progress) is the caller's (cli/bench.py).
"""

from __future__ import annotations

import inspect
import json
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prfaas.loadgen import client, report
from prfaas.loadgen.workload import Planned, WorkloadSpec

# One policy's run: (API placement, its cache salt, called as each request ends) -> (outcomes, wall seconds)
Send = Callable[[str, str, Callable[[client.Outcome], None]], tuple[list[client.Outcome], float]]


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during `run`: `summaries` and `rows` hold the policies that finished before it (none when it came
    during the warm-up or the first policy); the one running is dropped. A KeyboardInterrupt, so a caller that
    does not look for it stops as before."""

    def __init__(self, summaries: dict[str, dict[str, Any]], rows: list[dict[str, Any]]) -> None:
        super().__init__()
        self.summaries, self.rows = summaries, rows


def tokenizer(model: str) -> Callable[[str], list[int]]:
    """The model's tokenizer (text -> token ids, no special tokens). EngineError when the model is not
    prepared here."""
    from tokenizers import Tokenizer

    from prfaas.engine.models import resolve_model

    loaded = Tokenizer.from_file(str(Path(resolve_model(model)) / "tokenizer.json"))
    return lambda text: list(loaded.encode(text, add_special_tokens=False).ids)


def corpus(model: str) -> tuple[list[int], int]:
    """Real English and Python source as the model's token ids, and its context length.
    EngineError when the model is not prepared here."""
    import argparse
    import ast
    import typing

    from prfaas.engine.models import resolve_model

    text = "\n".join(inspect.getsource(m) for m in (argparse, ast, typing))
    config = json.loads((Path(resolve_model(model)) / "config.json").read_text())
    return tokenizer(model)(text), int(config.get("max_position_embeddings", 2048))


def planned(api_base: str, api_key: str, model: str, requests: list[Planned], concurrency: int | None,
            timeout_s: float) -> Send:  # fmt: skip
    """`Send` of planned requests (open loop at their times, or closed at `concurrency`)."""
    return lambda placement, salt, on_done: client.run(api_base, api_key, model, requests, placement, concurrency,
                                                       timeout_s, on_done, salt)  # fmt: skip


def run(
    api_base: str,
    api_key: str,
    model: str,
    send: Send,
    total: int,
    warm: list[Planned],
    policies: list[str],
    timeout_s: float,
    slo_s: tuple[float, float],
    progress: Callable[[str, int], Callable[[], None]] = lambda _name, _total: lambda: None,
) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]]]:
    """Each policy's summary (`report.summarize`; `slo_s`: TTFT and TPOT targets, seconds; and
    `identical_outputs`: replies equal to the same request's under the first other policy) and the
    trace rows of every request. `warm` requests run first on both paths, uncounted; `progress(policy,
    total)` returns what to call as each of that policy's `total` requests ends. Ctrl-C raises
    `Interrupted` with the policies that finished."""
    summaries: dict[str, dict[str, Any]] = {}
    texts: dict[str, dict[int, str]] = {}
    rows: list[dict[str, Any]] = []
    try:
        for placement in ("local", "split") if warm else ():  # both paths warm before any policy runs
            client.run(api_base, api_key, model, warm, placement, concurrency=1, timeout_s=timeout_s)
        for name in policies:
            advance = progress(name, total)

            def on_done(_outcome: client.Outcome, advance: Callable[[], None] = advance) -> None:
                advance()

            # a cache salt of the run's own: each policy starts with caches cold for this workload (the same
            # requests run under every policy, so another's run would have left them warm)
            outcomes, wall_s = send(client.PLACEMENTS[name], f"bench-{name}-{uuid.uuid4().hex[:8]}", on_done)
            client.attach_jobs(api_base, api_key, outcomes)
            summary = report.summarize(outcomes, wall_s, *slo_s)
            texts[name] = {o.index: o.text for o in outcomes if o.ok}
            rows += report.trace_rows(name, outcomes)
            summaries[name] = summary
    except KeyboardInterrupt:
        _compare_texts(summaries, texts)
        raise Interrupted(summaries, rows) from None
    _compare_texts(summaries, texts)
    return summaries, rows


def _compare_texts(summaries: dict[str, dict[str, Any]], texts: dict[str, dict[int, str]]) -> None:
    """Each finished policy's `identical_outputs`: replies equal to the same request's under the first other."""
    for name, summary in summaries.items():
        other = next((p for p in summaries if p != name), None)
        summary["identical_outputs"] = None if other is None else report.identical(texts[name], texts[other])


def result(
    api_base: str, model: str, spec: WorkloadSpec, concurrency: int | None, summaries: dict[str, dict[str, Any]],
    interrupted: bool = False,
) -> dict[str, Any]:  # fmt: skip
    """What bench.json holds: the policies' figures, the workload, and ratios to the first policy;
    `interrupted`: Ctrl-C stopped the run, and `policies` holds those that finished before it."""
    baseline = next(iter(summaries))
    out: dict[str, Any] = {
        "api_base": api_base, "model": model, "policies": summaries, "baseline": baseline, "interrupted": interrupted,
        "workload": {"num_requests": spec.num_requests, "rate_rps": spec.rate_rps, "concurrency": concurrency,
                     "burstiness": spec.burstiness, "input_len": spec.input_len, "output_len": spec.output_len,
                     "mix": spec.mix, "shared_prefix_tokens": spec.shared_prefix_tokens,
                     "prefix_groups": spec.prefix_groups, "seed": spec.seed,
                     "max_duration_s": spec.max_duration_s},
    }  # fmt: skip
    if len(summaries) > 1:
        out["ratios"] = report.ratios(summaries, baseline)
    return out


def write(folder: Path, bench: dict[str, Any], rows: list[dict[str, Any]], title: str) -> list[Path]:
    """bench.json, trace.jsonl and bench.png in `folder`; -> their paths."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = [folder / "bench.json", folder / "bench.png", folder / "trace.jsonl"]
    paths[0].write_text(json.dumps(bench, indent=2) + "\n")
    report.plot(paths[1], bench["policies"], title)
    report.write_trace(paths[2], rows)
    return paths
