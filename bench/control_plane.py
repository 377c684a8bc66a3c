"""Latency the control plane adds (API + Redis job store + scheduler + dispatch + metering) over
calling the decode region's `Generate` directly over gRPC.

    .venv/bin/python bench/control_plane.py [--rate 100] [--count 300] [--arrival poisson]
                                            [--client http|openai] [--json PATH]

Starts real processes on loopback (devstack/stack.py): the API (uvicorn), one Celery worker,
a prefill and a decode region (`prfaas region`, tiny-llama); Redis must run
(tests/ensure-services.sh). A short prompt with `max_tokens=1` is placed locally in the
decode region, so both paths end in the same `Generate` on the same process:

    direct  DecodeRegion.Generate over gRPC, from this process
    api     POST /v1/completions (keep-alive httpx, or the official `openai` client with
            `--client openai`): admission, the placement decided in the API and the job written
            handed off in one Redis script, Generate streamed from the decode region, DONE
            recorded, the job billed to the ledger by a background thread

Open loop at `--rate` requests/s (Poisson or fixed gaps), `--count` requests per path, in
alternating blocks of `--block` requests so that host noise lands on both paths alike.
Latency runs from each request's scheduled send time to its reply. Overhead is reported as
the difference of the two distributions' percentiles (api P50 - direct P50, api P99 - direct
P99). It also prints the CPU time (utime + stime, /proc) the API process and the decode region
spent per request on each path, which host load distorts far less than latency does. `--json
PATH` writes one row per rate: rate_rps, p50_ms, p99_ms (the overhead), the two paths' P50/P99,
api_cpu_ms_per_request and worker_cpu_ms_per_request (the API's and the Celery worker's CPU on the
api path), the CPU ms per request (`cpu_ms`: path -> process -> ms) and every sample in ms. Each call has a
timeout; processes are killed on exit.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import httpx
import openai

from prfaas.devstack.stack import Stack, wait_until
from prfaas.engine.models import prepare_model
from prfaas.loadgen import report
from prfaas.protos.prfaas.v1 import common_pb2, decode_pb2, decode_pb2_grpc

PROMPT = [5, 6, 7, 8]  # short: the scheduler runs it locally in the decode region
CALL_TIMEOUT_S = 30.0


def percentile(samples: list[float], q: float) -> float:
    """loadgen's percentile (linear interpolation between closest ranks, the one every bench reports), of a
    path that has samples (--count >= 1). api_floor.py reports with it too."""
    value = report.percentile(samples, q)
    assert value is not None, "no samples"
    return value


def send_times(count: int, rate_rps: float, arrival: str, rng: random.Random) -> list[float]:
    """Offsets in s from the block's start."""
    times, t = [], 0.0
    for _ in range(count):
        times.append(t)
        t += rng.expovariate(rate_rps) if arrival == "poisson" else 1.0 / rate_rps
    return times


def open_loop(call: Callable[[], None], offsets: list[float], pool: ThreadPoolExecutor) -> list[float]:
    """Latencies in ms, each from its scheduled send time (a late send counts against it)."""
    start = time.perf_counter() + 0.05

    def timed(at: float) -> float:
        call()
        return (time.perf_counter() - at) * 1e3

    futures = []
    for offset in offsets:
        at = start + offset
        delay = at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        futures.append(pool.submit(timed, at))
    return [f.result(timeout=CALL_TIMEOUT_S + 5) for f in futures]


def cpu_s(pid: int) -> float:
    """CPU time (user + system) process `pid` has used, s (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def summary(samples: list[float]) -> str:
    qs = (0, 10, 50, 90, 99, 100)
    return "  ".join(f"p{q}={percentile(samples, q):7.2f}" for q in qs) + f"  mean={statistics.fmean(samples):7.2f}"


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Counts and rates that leave a run with something to measure (before any process starts)."""
    for flag, value in (("--count", args.count), ("--block", args.block)):
        if value < 1:
            parser.error(f"{flag} {value}: at least 1")
    if args.warmup < 0:
        parser.error(f"--warmup {args.warmup}: at least 0")
    if bad := [r for r in args.rate if not r > 0]:
        parser.error(f"--rate {' '.join(map(str, bad))}: requests/s above 0")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=float, nargs="+", default=[100.0], help="requests/s, one run each")
    parser.add_argument("--count", type=int, default=300, help="requests per path per rate")
    parser.add_argument("--block", type=int, default=100, help="requests per alternating block")
    parser.add_argument("--arrival", choices=("poisson", "fixed"), default="poisson")
    parser.add_argument("--warmup", type=int, default=30, help="requests per path before measuring")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--client", choices=("http", "openai"), default="http",
        help="api path's client: keep-alive httpx (the control plane's cost alone) or the official openai client "
        "(adds its own ~1-2 ms of parsing per request in this process, which the gRPC direct path does not pay)",
    )  # fmt: skip
    parser.add_argument("--json", type=Path, help="write rows {rate_rps, p50_ms, p99_ms, ...} here")
    parser.add_argument(
        "--ledger-url", help="the ledger's database (SQLAlchemy URL; default: a SQLite file, as prfaas up uses)"
    )
    parser.add_argument(
        "--profile", type=Path,
        help="sample the API process with py-spy (the thread holding the GIL: where its Python CPU goes) during the "
        "measured runs and write its collapsed stacks here",
    )  # fmt: skip
    args = parser.parse_args()
    check_args(parser, args)

    prepare_model("tiny-llama")
    folder = Path(tempfile.mkdtemp(prefix="cp-bench-"))
    ledger = {"PRFAAS_LEDGER_URL": args.ledger_url} if args.ledger_url else {}
    stack = Stack(folder, PRFAAS_JOB_TIMEOUT_S=str(CALL_TIMEOUT_S), **ledger)
    rows: list[dict[str, Any]] = []
    try:
        stack.start_api()
        worker = stack.start_worker("bench", concurrency=8)
        stack.region("prefill-a", "prefill", 0.5)
        decode = stack.region("decode-b", "decode", 4.0)
        stack.put_link("prefill-a", "decode-b")
        wait_until(lambda: len(stack.healthy()) == 2, 30, 0.1)
        _, key = stack.tenant("bench", rps=1e5, concurrency=10_000, budget_usd=1e9)
        client = openai.OpenAI(base_url=stack.url + "/v1", api_key=key, max_retries=0, timeout=CALL_TIMEOUT_S)
        stub = decode_pb2_grpc.DecodeRegionStub(grpc.insecure_channel(decode.grpc))

        def direct() -> None:
            request = decode_pb2.GenerateRequest(
                job_id=str(uuid.uuid4()), token_ids=PROMPT, timeout_s=CALL_TIMEOUT_S,
                sampling=common_pb2.SamplingParams(max_new_tokens=1, temperature=0.0, top_p=1.0),
            )  # fmt: skip
            events = list(stub.Generate(request, timeout=CALL_TIMEOUT_S))
            assert len(events) == 1 and events[0].last

        http = httpx.Client(base_url=stack.url, headers={"Authorization": f"Bearer {key}"}, timeout=CALL_TIMEOUT_S)
        body = {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": 1}

        def api() -> None:
            if args.client == "openai":
                reply = client.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=1)
                assert reply.usage is not None and reply.usage.completion_tokens == 1
            else:
                answer = http.post("/v1/completions", json=body)
                assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 1, answer.text

        rng = random.Random(args.seed)
        profiler = None
        with ThreadPoolExecutor(max_workers=64) as pool:
            for call in (direct, api):  # warm both paths (connections, threads, the engine)
                open_loop(call, send_times(args.warmup, 20.0, "fixed", rng), pool)
            if args.profile and stack.api:
                profiler = subprocess.Popen(
                    [str(Path(sys.executable).with_name("py-spy")), "record", "--pid", str(stack.api.pid),
                     "--format", "raw", "--rate", "250", "--nonblocking", "--gil", "--output", str(args.profile)],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                )  # fmt: skip
                time.sleep(1.0)
            for rate in args.rate:
                samples: dict[str, list[float]] = {"direct": [], "api": []}
                pids = {"api": stack.api.pid, "worker": worker.pid, "decode": decode.proc.pid} if stack.api else {}
                spent = {path: dict.fromkeys(pids, 0.0) for path in samples}  # CPU s per path and process
                done = 0
                while done < args.count:
                    n = min(args.block, args.count - done)
                    for name, call in (("direct", direct), ("api", api)):
                        before = {p: cpu_s(pid) for p, pid in pids.items()}
                        samples[name] += open_loop(call, send_times(n, rate, args.arrival, rng), pool)
                        time.sleep(0.1)  # the API's ledger writer bills the block's last jobs
                        for p, pid in pids.items():
                            spent[name][p] += cpu_s(pid) - before[p]
                    done += n
                cpu_ms = {
                    path: {p: round(s * 1e3 / args.count, 3) for p, s in by.items()} for path, by in spent.items()
                }
                d, a = samples["direct"], samples["api"]
                row = {
                    "rate_rps": rate, "count": args.count, "arrival": args.arrival, "client": args.client,
                    "p50_ms": round(percentile(a, 50) - percentile(d, 50), 3),
                    "p99_ms": round(percentile(a, 99) - percentile(d, 99), 3),
                    "direct_p50_ms": round(percentile(d, 50), 3), "direct_p99_ms": round(percentile(d, 99), 3),
                    "api_p50_ms": round(percentile(a, 50), 3), "api_p99_ms": round(percentile(a, 99), 3),
                    # process CPU s over the run / requests: the figure host noise does not move (issue 26)
                    "api_cpu_ms_per_request": cpu_ms["api"]["api"],
                    "worker_cpu_ms_per_request": cpu_ms["api"]["worker"],
                    "cpu_ms": cpu_ms, "direct_ms": [round(x, 3) for x in d], "api_ms": [round(x, 3) for x in a],
                }  # fmt: skip
                rows.append(row)
                print(f"rate {rate:g} req/s, {args.count} requests per path, {args.arrival} arrivals (ms)")
                print(f"  direct  {summary(d)}")
                print(f"  api     {summary(a)}")
                for path, by in cpu_ms.items():
                    print(f"  CPU per request, {path} path: " + ", ".join(f"{p} {ms:.2f} ms" for p, ms in by.items()))
                print(f"  overhead P50 {row['p50_ms']:.2f} ms (target <= 5), P99 {row['p99_ms']:.2f} ms (target <= 20)")
    finally:
        if profiler:
            profiler.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
            profiler.wait(timeout=30)
        stack.stop()
        stack.cleanup()
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    sys.exit(0 if rows else 1)


if __name__ == "__main__":
    main()
