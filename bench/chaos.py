"""Chaos: requests at a steady rate through the whole product while faults hit it (issue 22).

    sudo .venv/bin/python bench/chaos.py --requests 200 --json docs/results/chaos.json

Brings up a deployment as `prfaas up` does (devstack/deployment.py; with root, every region in
a network namespace of its own behind emulated WAN links): the API, two Celery workers, two
prefill regions (prefill-a, prefill-b), a decode region of two instances (tiny-llama; the test
knobs `test_layer_delay_s` and `test_token_delay_s` stretch each prefill and decode to about a
second, so a fault finds work in flight). `--requests` streamed completions start at `--rate`
per second through the official `openai` client, each with an Idempotency-Key and retried
after a broken stream as a careful client would (loadgen/steady.py). Faults, at fractions of
the run: SIGKILL of prefill-a (restarted 10 s later, as a supervisor would), of decode
instance 0 (restarted 5 s later), of Celery worker 1 (restarted 3 s later), of the API
(restarted at once, same port), and (root) a cut of the prefill-b -> decode link for 5 s.

`--json` writes one object: `requests`, `done` (final chunk received, text equal to a
colocated run's), `wrong_text`, `failed_with_reason` (the API named why the job failed),
`lost` (a job never terminal), `double_billed` (a job with more than one DONE or its spend
counted twice), `streams_broken` (a request that never got its final chunk nor a reason, after
its retries), `stream_breaks_retried` (streams that broke and were retried), `ledger_matches`
(the ledger's sum for the tenant = its spend in Redis), `faults` (what was done when), and
timings (`wall_s`: monotonic). Options that would send nothing (`--rate` not above 0, `--requests`,
`--prompts` or `--max-tokens` under 1, `--deadline-s` not above 0) are refused (exit 2) before the
model loads and the deployment starts.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import random
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

from prfaas.bench.deployment_kit import add_steady_load_options, at_least_one, fresh_deployment, positive
from prfaas.control_plane.billing.ledger import Ledger
from prfaas.devstack.deployment import Deployment
from prfaas.devstack.topology import split_topology
from prfaas.engine.hf import HFEngine
from prfaas.engine.sampling import SamplingParams
from prfaas.loadgen import steady

MODEL = "tiny-llama"
SLOW_LAYERS = {"test_layer_delay_s": 0.15}
TOPOLOGY = split_topology(
    "chaos", MODEL,
    regions=[
        {"name": "prefill-a", "role": "prefill", "usd_per_gpu_hour": 0.5, "extra": SLOW_LAYERS},
        {"name": "prefill-b", "role": "prefill", "usd_per_gpu_hour": 0.6, "extra": SLOW_LAYERS},
        {"name": "dec", "role": "decode", "usd_per_gpu_hour": 4.0, "instances": 2, "kv_buffer_bytes": "512MiB",
         "extra": {"test_token_delay_s": 0.05}},
    ],
    links=[
        {"src": "prefill-a", "dst": "dec", "rtt_ms": 20, "rate_mbit": 200},
        {"src": "prefill-b", "dst": "dec", "rtt_ms": 30, "rate_mbit": 200},
    ],
    workers=2,
)  # fmt: skip
TERMINAL = {b"DONE", b"FAILED", b"CANCELED"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=at_least_one, default=200)
    add_steady_load_options(parser)  # --rate > 0, --max-tokens >= 1: checked before the model and the deployment
    parser.add_argument("--prompts", type=at_least_one, default=8,
                        help="distinct prompts (each checked against a local run)")  # fmt: skip
    parser.add_argument("--deadline-s", type=positive, default=120.0,
                        help="a request gives up this long after its start")  # fmt: skip
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    root = os.geteuid() == 0
    os.environ.setdefault("PRFAAS_REDIS_URL", "redis://127.0.0.1:6379/0")
    engine = HFEngine(MODEL)
    corpus = engine.encode(Path(json.__file__).read_text() * 4)
    prompts = [corpus[i * 350 : i * 350 + 300] for i in range(args.prompts)]
    expected = [engine.decode_text(engine.generate(p, SamplingParams(max_new_tokens=args.max_tokens))) for p in prompts]
    deployment = fresh_deployment(TOPOLOGY, root, lambda m: print(m, flush=True), prefix="prfaas-chaos-")
    try:
        state = deployment.start()
        n = len(prompts)
        asked = [steady.Asked(i, i / args.rate, prompts[i % n], args.max_tokens) for i in range(args.requests)]
        run_s = args.requests / args.rate
        faults = Faults(deployment, run_s, root)
        started = time.monotonic()  # a wall-clock step (NTP) mid-run is not the run's length
        steady.run(state.api_base, state.api_key, MODEL, asked, deadline_s=args.deadline_s, on_tick=faults.tick)
        faults.finish()
        report = tally(deployment, state.tenant_id, asked, expected, prompts, faults.done, time.monotonic() - started)
    finally:
        deployment.stop()
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    ok = (report["lost"] == 0 and report["double_billed"] == 0 and report["streams_broken"] == 0
          and report["ledger_matches"] and report["done"] >= 0.97 * report["requests"])  # fmt: skip
    return 0 if ok else 1


class Faults:
    """The schedule of faults, each at a fraction of the run (and its repair, as a supervisor's)."""

    def __init__(self, deployment: Deployment, run_s: float, root: bool) -> None:
        self.d = deployment
        self.done: list[dict[str, Any]] = []
        plan: list[tuple[float, str, Callable[[], object]]] = [
            (0.15 * run_s, "SIGKILL region-prefill-a", lambda: deployment.kill("region-prefill-a")),
            (0.15 * run_s + 10, "restart region-prefill-a", lambda: deployment.restart("region-prefill-a")),
            (0.30 * run_s, "SIGKILL region-dec-0", lambda: deployment.kill("region-dec-0")),
            (0.30 * run_s + 5, "restart region-dec-0", lambda: deployment.restart("region-dec-0")),
            (0.45 * run_s, "SIGKILL worker-1", lambda: deployment.kill("worker-1")),
            (0.45 * run_s + 3, "restart worker-1", lambda: deployment.restart("worker-1")),
            (0.60 * run_s, "SIGKILL api, restart it", self._api),
        ]
        if root:
            plan += [
                (0.75 * run_s, "cut link prefill-b -> dec", lambda: deployment.cut_link("prefill-b", "dec", True)),
                (0.75 * run_s + 5, "restore link prefill-b -> dec", lambda: deployment.cut_link("prefill-b", "dec",
                                                                                                False)),
            ]  # fmt: skip
        self.plan = sorted(plan, key=lambda p: p[0])
        self._busy: threading.Thread | None = None

    def _api(self) -> None:
        self.d.kill("api")
        self.d.restart("api")

    def tick(self, now_s: float) -> None:
        if self._busy is not None and self._busy.is_alive():
            return  # a restart (model load) is still under way: the next fault waits for it
        if self.plan and self.plan[0][0] <= now_s:
            _, what, act = self.plan.pop(0)
            self.done.append({"at_s": round(now_s, 2), "what": what})
            print(f"[{now_s:7.2f} s] {what}", flush=True)
            self._busy = threading.Thread(target=act, daemon=True)
            self._busy.start()

    def finish(self) -> None:
        while self.plan or (self._busy is not None and self._busy.is_alive()):
            self.tick(float("inf"))
            time.sleep(0.1)


def tally(deployment: Deployment, tenant: str, asked: list[steady.Asked], expected: list[str],
          prompts: list[list[int]], faults: list[dict[str, Any]], wall_s: float) -> dict[str, Any]:  # fmt: skip
    state = deployment.state
    client: Any = redis.Redis.from_url(state.redis_url)
    prefix = state.key_prefix
    job_ids = [j.decode() for j in client.zrange(f"{prefix}:tenant:{tenant}:jobs", 0, -1)]
    grace = time.monotonic() + 30  # every job must be terminal by then (the sweeper's work included)
    while time.monotonic() < grace and not all(client.hget(f"{prefix}:job:{j}", "state") in TERMINAL for j in job_ids):
        time.sleep(0.5)
    lost = [j for j in job_ids if client.hget(f"{prefix}:job:{j}", "state") not in TERMINAL]
    done_count = {j: sum(1 for e in client.lrange(f"{prefix}:job:{j}:timeline", 0, -1) if b'"DONE"' in e)
                  for j in job_ids}  # fmt: skip
    done_jobs = {j for j, n in done_count.items() if n >= 1}
    retried = sum(1 for j in job_ids if int(client.hget(f"{prefix}:job:{j}", "attempt") or 1) > 1)
    ledger = Ledger(os.environ["PRFAAS_LEDGER_URL"], migrate=False)
    month = dt.datetime.now(dt.UTC).replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    entries: set[str] = set()
    billing = time.monotonic() + 90  # a DONE job whose API process died before billing it: beat's sweep, each minute
    while time.monotonic() < billing and not done_jobs <= entries:
        entries = {e.job_id for e in ledger.entries(tenant, month, month + dt.timedelta(days=32))}
        time.sleep(1)
    time.sleep(2)  # spend follows the entries
    ledger_sum = ledger.spend(tenant, month, month + dt.timedelta(days=32))
    ledger.close()
    spend = float(client.get(f"{prefix}:tenant:{tenant}:spend:{time.strftime('%Y%m', time.gmtime())}") or 0)
    client.close()
    by_prompt = {tuple(p): e for p, e in zip(prompts, expected, strict=True)}
    done = [a for a in asked if a.finished and a.text == by_prompt[tuple(a.prompt)]]
    wrong = [a for a in asked if a.finished and a.text != by_prompt[tuple(a.prompt)]]
    failed = [a for a in asked if not a.finished and a.error and a.error != "deadline"]  # a reason the API gave
    broken = [a for a in asked if not a.finished and a.error in ("", "deadline")]  # ran out of time unanswered
    return {
        "requests": len(asked), "done": len(done), "wrong_text": len(wrong), "failed_with_reason": len(failed),
        "lost": len(lost), "double_billed": sum(1 for n in done_count.values() if n > 1),
        "streams_broken": len(broken), "stream_breaks_retried": sum(a.breaks for a in asked),
        "ledger_matches": abs(ledger_sum - spend) <= 1e-9 * max(1.0, spend) and done_jobs == entries,
        "ledger_usd": ledger_sum, "spend_usd": spend, "jobs": len(job_ids), "jobs_retried": retried, "faults": faults,
        "failure_reasons": sorted({a.error for a in failed})[:10], "wall_s": round(wall_s, 1),
        "done_not_billed": sorted(done_jobs - entries)[:5], "billed_not_done": sorted(entries - done_jobs)[:5],
        "emulated_wan": deployment.state.emulate_wan,
    }  # fmt: skip


if __name__ == "__main__":
    random.seed(0)
    sys.exit(main())
