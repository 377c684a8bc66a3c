"""Soak: a steady load through the whole product for a long while, and what it leaves behind (issue 22).

    .venv/bin/python bench/soak.py --minutes 30 --rate 2 --json docs/results/soak.json

Brings up a deployment as `prfaas up` does (devstack/deployment.py: the API, a Celery worker,
beat, a prefill and a decode region of tiny-llama, on loopback; with root and `--emulate-wan`,
in namespaces behind an emulated link) with a short job TTL (`--job-ttl-s`, so that finished
jobs' keys expire within the run), and sends `--rate` streamed completions a second for
`--minutes` through the official `openai` client (loadgen/steady.py). Every 10 s it samples the
RSS of every process of the deployment. Then it waits out the job TTL and counts the
deployment's Redis keys again, against a baseline counted at rest after one first request (and its
job TTL): what serving once leaves for good, the tenant's spend of the month, is state, not a leak.

`--json` writes: `rss_slope_mb_per_min` per process (least squares over the samples after a
2-minute warm-up), `rss_mb` first and last per process, `redis_keys_start` (at rest, the job TTL
after a first request), `redis_keys_end` (the job TTL after the last one ended), `requests`, `done`, `errors`
(requests that did not end with their final chunk), and the settings used. Exit 0 when every
process's RSS slope is under 1 MB/min (a run without 3 samples past the warm-up, or without any,
measured nothing: exit 1), no request failed and the keys grew by 10 % at most; `--rate`,
`--minutes` and `--max-tokens` that would send nothing are refused (exit 2) before the deployment starts.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import redis

from prfaas.bench.deployment_kit import add_steady_load_options, fresh_deployment, positive
from prfaas.devstack.deployment import Deployment
from prfaas.devstack.topology import split_topology
from prfaas.engine.hf import HFEngine
from prfaas.loadgen import steady

MODEL = "tiny-llama"
SAMPLE_S = 10.0
WARMUP_S = 120.0
TOPOLOGY = split_topology(
    "soak", MODEL,
    regions=[
        {"name": "prefill-a", "role": "prefill", "usd_per_gpu_hour": 0.5},
        {"name": "dec", "role": "decode", "usd_per_gpu_hour": 4.0, "kv_buffer_bytes": "512MiB"},
    ],
    links=[{"src": "prefill-a", "dst": "dec", "rtt_ms": 20, "rate_mbit": 200}],
    budget_usd=100000,
)  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=positive, default=30.0)
    add_steady_load_options(parser)
    parser.add_argument("--job-ttl-s", type=int, default=120, help="finished jobs' keys live this long")
    parser.add_argument("--emulate-wan", action="store_true", help="regions in namespaces (root)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    count = int(args.minutes * 60 * args.rate)
    if count < 1:  # before the deployment: a soak that sends nothing would pass
        parser.error(f"--minutes {args.minutes:g} at --rate {args.rate:g} is not one request")
    os.environ["PRFAAS_JOB_TTL_S"] = str(args.job_ttl_s)
    os.environ.setdefault("PRFAAS_REDIS_URL", "redis://127.0.0.1:6379/0")
    corpus = HFEngine(MODEL).encode(Path(json.__file__).read_text() * 4)
    deployment = fresh_deployment(
        TOPOLOGY, args.emulate_wan and os.geteuid() == 0, lambda m: print(m, flush=True), prefix="prfaas-soak-"
    )
    samples: dict[str, list[tuple[float, float]]] = {}
    try:
        state = deployment.start()
        keys = Keys(state.redis_url, state.key_prefix)
        # The baseline is the deployment at rest after it served once: what one request leaves for good (the
        # tenant's spend of the month, its first bill's) is state, not a leak; its job's own keys expire.
        first = [steady.Asked(-1, 0.0, corpus[:300], args.max_tokens)]
        steady.run(state.api_base, state.api_key, MODEL, first, deadline_s=120.0)
        print(f"first request served; waiting {args.job_ttl_s + 30} s for its keys to expire", flush=True)
        time.sleep(args.job_ttl_s + 30)
        keys_start = keys.names()
        asked = [steady.Asked(i, i / args.rate, corpus[(i % 16) * 350 : (i % 16) * 350 + 300], args.max_tokens)
                 for i in range(count)]  # fmt: skip
        next_sample = [0.0]

        def tick(now_s: float) -> None:
            if now_s >= next_sample[0]:
                sample(deployment, now_s, samples)
                next_sample[0] = now_s + SAMPLE_S

        steady.run(state.api_base, state.api_key, MODEL, asked, deadline_s=120.0, on_tick=tick)
        print(f"load done; waiting {args.job_ttl_s + 30} s for the job TTL", flush=True)
        time.sleep(args.job_ttl_s + 30)
        keys_end = keys.names()
    finally:
        deployment.stop()
    report = {
        "minutes": args.minutes, "rate": args.rate, "job_ttl_s": args.job_ttl_s, "requests": len(asked),
        "done": sum(a.finished for a in asked), "errors": sum(not a.finished for a in asked),
        "rss_slope_mb_per_min": {name: slope(points) for name, points in sorted(samples.items())},
        "rss_mb": {name: [round(points[0][1], 1), round(points[-1][1], 1)] for name, points in sorted(samples.items())},
        "redis_keys_start": len(keys_start), "redis_keys_end": len(keys_end),
        "redis_keys_left": sorted(k.removeprefix(deployment.state.key_prefix) for k in keys_end - keys_start)[:20],
    }  # fmt: skip
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    slopes = report["rss_slope_mb_per_min"].values()
    slopes_ok = bool(slopes) and all(v is not None and v < 1.0 for v in slopes)  # no sample: nothing measured
    ok = slopes_ok and report["errors"] == 0 and len(keys_end) <= 1.1 * len(keys_start)
    return 0 if ok else 1


class Keys:
    def __init__(self, url: str, prefix: str) -> None:
        self.client: Any = redis.Redis.from_url(url)
        self.prefix = prefix

    def names(self) -> set[str]:
        return {k.decode() for k in self.client.scan_iter(f"{self.prefix}:*", count=1000)}


def sample(deployment: Deployment, now_s: float, into: dict[str, list[tuple[float, float]]]) -> None:
    """RSS (MB) of every running process of the deployment, its children included."""
    for name, proc in list(deployment.procs.items()):
        try:
            p = psutil.Process(proc.pid)
            rss = p.memory_info().rss + sum(c.memory_info().rss for c in p.children(recursive=True))
        except psutil.Error:
            continue
        into.setdefault(name, []).append((now_s, rss / 2**20))


def slope(points: list[tuple[float, float]]) -> float | None:
    """MB per minute, least squares over the samples after the warm-up (None: too few)."""
    late = [(t / 60.0, mb) for t, mb in points if t >= WARMUP_S]
    if len(late) < 3:
        return None
    n = len(late)
    mt, mm = sum(t for t, _ in late) / n, sum(m for _, m in late) / n
    var = sum((t - mt) ** 2 for t, _ in late)
    return round(sum((t - mt) * (m - mm) for t, m in late) / var, 4) if var else None


if __name__ == "__main__":
    sys.exit(main())
