"""Measured links move placements: one of two equal paths slows to 1/10 mid-run (issue 23).

    sudo .venv/bin/python bench/link_shift.py --json docs/results/link-shift.json

Brings up a deployment as `prfaas up --emulate-wan` does (devstack/deployment.py; root: every
region in a network namespace of its own behind emulated WAN links): the API, a Celery worker,
two prefill regions (pre-a, pre-b: same price, same links: 40 ms RTT, 100 Mbit/s) and a decode
region (tiny-llama, 1 KiB of KV per token, 3,000-token prompts: ~3 MB a shipment). Streamed
completions start at `--rate` per second through the official `openai` client; at
`--slow-at-s` the emulator slows the link of the prefill region that took most of the last 10 s
of requests to 1/10 of its rate (SIGRTMIN+2: devstack/linkemu). The run is made twice, one
deployment each: with measured links (the default) and with `PRFAAS_MEASURE_LINKS=false` (the
configured links only: the static baseline).

`--json` writes: `shift_s` (from the slowdown to the first request from which on at least 80 %
of the split placements went to the other path, measured run), `share_after` (the other path's
share of the splits started 10 s or more after the slowdown, measured run), `last_on_slowed_s`
(the start of the last split the slowed path still took, measured run), `slowed` (which path,
per run), `ttft_p90_measured_s` and
`ttft_p90_static_s` (client-side time to the first streamed token, over each run), and per
run the requests with their start, TTFT and prefill region.

The TTFT P90s (loadgen's percentile: linear interpolation) are over the requests that streamed
a token; a request that did not (an error, a stream that ended without text: `no_text`, or one
still open when the run stopped waiting) has no TTFT and is not counted at a deadline either:
`ttft_failed` gives, per run, how many requests had no TTFT and their share of the run, to be
read next to the P90 (a P90 over 90 % of the requests is not one over all of them).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import openai

from prfaas.bench.deployment_kit import fresh_deployment
from prfaas.devstack.topology import split_topology
from prfaas.loadgen.report import percentile

MODEL = "tiny-llama"
PREFILL = ("pre-a", "pre-b")
TOPOLOGY = split_topology(
    "shift", MODEL,
    regions=[
        {"name": PREFILL[0], "role": "prefill", "usd_per_gpu_hour": 0.5},
        {"name": PREFILL[1], "role": "prefill", "usd_per_gpu_hour": 0.5},
        {"name": "dec", "role": "decode", "usd_per_gpu_hour": 4.0, "kv_buffer_bytes": "1GiB"},
    ],
    links=[
        {"src": PREFILL[0], "dst": "dec", "rtt_ms": 40, "rate_mbit": 100},
        {"src": PREFILL[1], "dst": "dec", "rtt_ms": 40, "rate_mbit": 100},
    ],
    worker_concurrency=8,
)  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=1.5, help="requests started per second")
    parser.add_argument("--run-s", type=float, default=60.0)
    parser.add_argument("--slow-at-s", type=float, default=20.0)
    parser.add_argument("--prompt-tokens", type=int, default=3000)
    parser.add_argument("--modes", default="measured,static", help="which runs (measured, static)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("needs root: network namespaces and TUN devices (the emulated WAN)", file=sys.stderr)
        return 2
    from prfaas.engine.hf import HFEngine  # torch: only for a run, not for the report's functions

    engine = HFEngine(MODEL)
    corpus = engine.encode(Path(json.__file__).read_text() * 8)
    n = int(args.rate * args.run_s)
    prompts = [corpus[(i * 97) % 5000 : (i * 97) % 5000 + args.prompt_tokens] for i in range(n)]
    runs = {}
    for mode in args.modes.split(","):
        _wait_devices_gone()
        runs[mode] = run(mode, prompts, args)
    report = summarize(runs, args.slow_at_s)
    print(json.dumps({k: v for k, v in report.items() if k != "runs"}, indent=2))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


def run(mode: str, prompts: list[list[int]], args: argparse.Namespace) -> dict[str, Any]:
    os.environ["PRFAAS_MEASURE_LINKS"] = "true" if mode == "measured" else "false"
    deployment = fresh_deployment(
        TOPOLOGY, True, lambda m: print(f"[{mode}] {m}", flush=True), prefix=f"prfaas-shift-{mode}-"
    )
    rows: list[dict[str, Any]] = []
    links: list[dict[str, Any]] = []  # /admin/links every second: what the scheduler saw
    stop = threading.Event()
    try:
        state = deployment.start()
        client = openai.OpenAI(base_url=state.api_base, api_key=state.api_key, max_retries=0,
                               timeout=httpx.Timeout(180.0, connect=5.0))  # fmt: skip
        for prompt in prompts[:3]:  # warm-up: every process has run a job
            client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
        t0 = time.monotonic()
        threads = []
        slowed, busiest = False, ""
        watcher = threading.Thread(target=_watch_links, args=(state, t0 + args.slow_at_s, links, stop), daemon=True)
        watcher.start()
        for i, prompt in enumerate(prompts):
            while (now := time.monotonic() - t0) < i / args.rate:
                if not slowed and now >= args.slow_at_s:
                    busiest = _busiest(state, rows[-int(10 * args.rate) :])
                    deployment.slow_link(busiest, "dec", True)
                    slowed = True
                    print(f"[{mode}] {now:.1f} s: link {busiest} -> dec slowed to 1/10", flush=True)
                time.sleep(0.01)
            row: dict[str, Any] = {"index": i, "start_s": now - args.slow_at_s, "slowed": busiest if slowed else None}
            rows.append(row)
            thread = threading.Thread(target=_one, args=(client, prompt, row), daemon=True)
            thread.start()
            threads.append(thread)
        for thread in threads:
            thread.join(240)
        stop.set()
        auth = {"Authorization": f"Bearer {state.api_key}"}
        for row in rows:
            if row.get("job_id"):
                job = httpx.get(f"{state.api_base}/jobs/{row['job_id']}", headers=auth, timeout=10).json()
                row["placement"], row["prefill_region"] = job.get("placement_chosen"), job.get("prefill_region")
                stages = ((job.get("decision") or {}).get("explanation") or {}).get("stages") or []
                prefill: dict[str, Any] = next((st for st in stages if st.get("stage") == "prefill"), {})
                row["scores"], row["cut"] = prefill.get("scores"), prefill.get("cut")  # why this region
    finally:
        stop.set()
        deployment.stop()
    return {"requests": rows, "links": links}


def _watch_links(state: Any, slow_at: float, out: list[dict[str, Any]], stop: threading.Event) -> None:
    base = state.api_base.removesuffix("/v1")
    while not stop.wait(1.0):
        try:
            links = httpx.get(f"{base}/admin/links", headers={"Authorization": f"Bearer {state.admin_key}"},
                              timeout=5).json()  # fmt: skip
        except httpx.HTTPError:
            continue
        out.append(
            {
                "t_s": round(time.monotonic() - slow_at, 2),
                **{link["src"]: {"scheduled": link["scheduled"], "measured": link["measured"]} for link in links},
            }
        )


def _busiest(state: Any, rows: list[dict[str, Any]]) -> str:
    """The prefill region that took most of `rows` (the path to slow: the one carrying the work)."""
    counts = dict.fromkeys(PREFILL, 0)
    auth = {"Authorization": f"Bearer {state.api_key}"}
    for row in rows:
        if row.get("job_id"):
            job = httpx.get(f"{state.api_base}/jobs/{row['job_id']}", headers=auth, timeout=10).json()
            if job.get("prefill_region") in counts:
                counts[job["prefill_region"]] += 1
    return max(sorted(counts), key=lambda name: counts[name])


def _wait_devices_gone(timeout_s: float = 30.0) -> None:
    """The emulated WAN's devices are named after this process (devstack/network.py): a second
    deployment must wait until the kernel has removed the first one's."""
    tag = f"pu{os.getpid()}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        out = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, timeout=10, check=False).stdout
        if tag not in out:
            return
        time.sleep(0.5)


def _one(client: openai.OpenAI, prompt: list[int], row: dict[str, Any]) -> None:
    """Stream one completion; `ttft_s` only when a chunk carried text (no TTFT is made up), `no_text`
    when the stream ended without any, `error` when it failed."""
    started = time.monotonic()
    try:
        for chunk in client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, stream=True):
            row.setdefault("job_id", chunk.id)
            if "ttft_s" not in row and chunk.choices and chunk.choices[0].text:
                row["ttft_s"] = time.monotonic() - started
        if "ttft_s" not in row:
            row["no_text"] = True
        row["done_s"] = time.monotonic() - started
    except openai.OpenAIError as exc:
        row["error"] = f"{type(exc).__name__}: {exc}"


def _p90(rows: list[dict[str, Any]]) -> float | None:
    """P90 of the TTFTs the requests had (loadgen's percentile); those without one: `_failed`."""
    return percentile([r["ttft_s"] for r in rows if "ttft_s" in r], 90)


def _failed(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Requests without a TTFT (failed, no text, or unfinished when the run stopped waiting) and their share."""
    count = sum("ttft_s" not in r for r in rows)
    return {
        "count": count, "share": count / len(rows) if rows else None, "requests": len(rows),
        "no_text": sum(bool(r.get("no_text")) for r in rows), "errors": sum("error" in r for r in rows),
    }  # fmt: skip


def summarize(runs: dict[str, dict[str, Any]], slow_at_s: float) -> dict[str, Any]:
    requests = {mode: result["requests"] for mode, result in runs.items()}
    measured = [r for r in requests.get("measured", []) if r.get("placement") == "split"]
    slowed = next((r["slowed"] for r in measured if r.get("slowed")), None)

    def other(row: dict[str, Any]) -> bool:
        return bool(row["prefill_region"] != slowed)

    after = [r for r in measured if r["start_s"] >= 10.0]
    shift_s = None
    for row in (r for r in measured if r["start_s"] >= 0):
        later = [r for r in measured if r["start_s"] >= row["start_s"]]
        if sum(other(r) for r in later) >= 0.8 * len(later):
            shift_s = row["start_s"]
            break
    on_slowed = [r["start_s"] for r in measured if r["start_s"] >= 0 and not other(r)]
    return {
        "shift_s": shift_s,
        "last_on_slowed_s": max(on_slowed) if on_slowed else None,  # the last split the slowed path took
        "share_after": sum(other(r) for r in after) / len(after) if after else None,
        "slowed": {mode: next((r["slowed"] for r in rows if r.get("slowed")), None) for mode, rows in requests.items()},
        "ttft_p90_measured_s": _p90(requests.get("measured", [])),
        "ttft_p90_static_s": _p90(requests.get("static", [])),
        "ttft_failed": {mode: _failed(rows) for mode, rows in requests.items()},  # read next to the P90s
        "errors": {mode: sum("error" in r for r in rows) for mode, rows in requests.items()},
        "placements": {mode: _count(rows) for mode, rows in requests.items()},
        "slow_at_s": slow_at_s,
        "runs": runs,
    }


def _count(rows: list[dict[str, Any]]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for row in rows:
        key = f"{row.get('placement')}:{row.get('prefill_region')}"
        counts[key] = counts.get(key, 0) + 1
    return counts


if __name__ == "__main__":
    sys.exit(main())
