"""The CPU floor of the API's local path: what the libraries it is built on cost per request before any of
prfaas's own work, measured part by part.

    .venv/bin/python bench/api_floor.py [--rate 100] [--count 300] [--rounds 2] [--json PATH]

A skeleton app (`skeleton`, below) is served by uvicorn as the API is, in a process of its own, and driven
open loop (Poisson) at `--rate` with keep-alive httpx; its process CPU time (utime + stime) over the
requests ÷ requests is the figure. Each variant adds parts of the real request path, in a sync route (a
`def` route: anyio's thread pool, redis-py, grpcio, as api/completions.py is today) and an async one
(`async def`, redis.asyncio, grpc.aio):

    none         FastAPI routing, a pydantic body, a JSON reply (no I/O)
    redis        + three Lua calls (admit, create, DONE: each a hash write, a list push, expiries)
    unary        + one unary gRPC call to the decode region (Cancel of an unknown job: no work there)
    stream       + the decode region's `Generate` stream, one token (what the local path calls)
    redis+stream both: the skeleton of a local completion

The decode region is a real `prfaas region` process (tiny-llama) on loopback, Redis the local one
(tests/ensure-services.sh). `--json PATH`: one row per variant and round {mode, parts, rate_rps,
count, cpu_ms_per_request, p50_ms, p99_ms}."""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
from pydantic import BaseModel

from prfaas.bench.control_plane import cpu_s, open_loop, percentile, send_times
from prfaas.devstack.processes import free_port
from prfaas.devstack.stack import Stack
from prfaas.engine.models import prepare_model

VARIANTS = ("none", "redis", "unary", "stream", "redis+stream")
LUA = """redis.call('HSET', KEYS[1], 'state', ARGV[1], 'job', ARGV[2], 'fields', ARGV[3])
redis.call('EXPIRE', KEYS[1], 60)
redis.call('RPUSH', KEYS[2], ARGV[1])
redis.call('EXPIRE', KEYS[2], 60)
return {ARGV[1], 'ok'}"""


class Body(BaseModel):  # at module level: FastAPI resolves the route's annotations here
    model: str
    prompt: list[int]
    max_tokens: int = 1


def skeleton() -> Any:
    """The app uvicorn serves (`--factory`): mode and parts from API_FLOOR_MODE / API_FLOOR_PARTS, the decode
    region from API_FLOOR_DECODE."""
    import grpc
    import redis
    import redis.asyncio as aredis
    from fastapi import FastAPI

    from prfaas.protos.prfaas.v1 import common_pb2, decode_pb2, decode_pb2_grpc

    mode, parts, target = os.environ["API_FLOOR_MODE"], os.environ["API_FLOOR_PARTS"], os.environ["API_FLOOR_DECODE"]
    writes, unary, stream = "redis" in parts, parts == "unary", "stream" in parts
    app = FastAPI()

    def generate(job: str) -> decode_pb2.GenerateRequest:
        sampling = common_pb2.SamplingParams(max_new_tokens=1, temperature=0.0, top_p=1.0)
        return decode_pb2.GenerateRequest(job_id=job, token_ids=[5, 6, 7, 8], timeout_s=30, sampling=sampling)

    def reply(job: str, tokens: int) -> dict[str, Any]:
        return {"id": job, "choices": [{"index": 0, "text": ""}], "usage": {"completion_tokens": tokens}}

    if mode == "async":
        script = aredis.Redis().register_script(LUA)
        stubs: list[Any] = []

        @app.post("/v1/completions")
        async def completions_async(body: Body) -> dict[str, Any]:
            if not stubs:  # the channel belongs to the server's event loop
                stubs.append(decode_pb2_grpc.DecodeRegionStub(grpc.aio.insecure_channel(target)))
            job, tokens = str(uuid.uuid4()), 1
            keys = [f"floor:{job}", f"floor:{job}:timeline"]
            for state in ("ADMITTED", "LOCAL") if writes else ():
                await script(keys=keys, args=[state, job, json.dumps(body.model_dump())])
            if unary:
                await stubs[0].Cancel(common_pb2.CancelRequest(job_id=job, reason="floor"), timeout=30)
            if stream:
                tokens = len([e async for e in stubs[0].Generate(generate(job), timeout=30)])
            if writes:
                await script(keys=keys, args=["DONE", job, "{}"])
            return reply(job, tokens)

    else:
        sync_script = redis.Redis().register_script(LUA)
        stub = decode_pb2_grpc.DecodeRegionStub(grpc.insecure_channel(target))

        @app.post("/v1/completions")
        def completions(body: Body) -> dict[str, Any]:
            job, tokens = str(uuid.uuid4()), 1
            keys = [f"floor:{job}", f"floor:{job}:timeline"]
            for state in ("ADMITTED", "LOCAL") if writes else ():
                sync_script(keys=keys, args=[state, job, json.dumps(body.model_dump())])
            if unary:
                stub.Cancel(common_pb2.CancelRequest(job_id=job, reason="floor"), timeout=30)
            if stream:
                tokens = len(list(stub.Generate(generate(job), timeout=30)))
            if writes:
                sync_script(keys=keys, args=["DONE", job, "{}"])
            return reply(job, tokens)

    return app


def measure(mode: str, parts: str, decode: str, rate: float, count: int, rng: random.Random) -> dict[str, Any]:
    port = free_port()
    env = dict(os.environ, API_FLOOR_MODE=mode, API_FLOOR_PARTS=parts, API_FLOOR_DECODE=decode)
    server = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "--factory", "prfaas.bench.api_floor:skeleton", "--port", str(port),
         "--log-level", "warning", "--no-access-log"], env=env,
    )  # fmt: skip
    try:
        http = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30)
        body = {"model": "tiny-llama", "prompt": [5, 6, 7, 8], "max_tokens": 1}
        deadline = time.monotonic() + 60
        while True:
            try:
                http.post("/v1/completions", json=body).raise_for_status()
                break
            except httpx.TransportError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise SystemExit(f"the {mode} {parts} skeleton did not start") from None
                time.sleep(0.2)

        def call() -> None:
            http.post("/v1/completions", json=body).raise_for_status()

        with ThreadPoolExecutor(max_workers=64) as pool:
            open_loop(call, send_times(50, 20.0, "fixed", rng), pool)  # warm-up
            before = cpu_s(server.pid)
            latencies = open_loop(call, send_times(count, rate, "poisson", rng), pool)
            spent = cpu_s(server.pid) - before
        return {
            "mode": mode, "parts": parts, "rate_rps": rate, "count": count,
            "cpu_ms_per_request": round(spent * 1e3 / count, 3),
            "p50_ms": round(percentile(latencies, 50), 3), "p99_ms": round(percentile(latencies, 99), 3),
        }  # fmt: skip
    finally:
        server.terminate()
        server.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=float, default=100.0, help="requests/s")
    parser.add_argument("--count", type=int, default=300, help="requests per variant and round")
    parser.add_argument("--rounds", type=int, default=2, help="passes over every variant (they alternate)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args()
    variants = args.variants.split(",")
    if unknown := set(variants) - set(VARIANTS):
        parser.error(f"unknown variants {sorted(unknown)}")
    for flag, value in (("--count", args.count), ("--rounds", args.rounds)):
        if value < 1:
            parser.error(f"{flag} {value}: at least 1")
    if not args.rate > 0:
        parser.error(f"--rate {args.rate}: requests/s above 0")

    prepare_model("tiny-llama")
    folder = Path(tempfile.mkdtemp(prefix="api-floor-"))
    stack = Stack(folder)
    rows: list[dict[str, Any]] = []
    rng = random.Random(0)
    try:
        decode = stack.region("decode-b", "decode", 4.0)
        for _ in range(args.rounds):
            for parts in variants:
                for mode in ("sync", "async"):
                    row = measure(mode, parts, decode.grpc, args.rate, args.count, rng)
                    rows.append(row)
                    print(f"{mode:5} {parts:12} {row['cpu_ms_per_request']:6.3f} ms CPU/request   "
                          f"p50 {row['p50_ms']:7.2f}  p99 {row['p99_ms']:7.2f} ms", flush=True)  # fmt: skip
    finally:
        stack.stop()
        stack.cleanup()
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
