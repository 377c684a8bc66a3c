"""Calibration: measure the local deployment's per-region timings, replay a workload file on
the real stack, and compare the simulator's TTFT P50 prediction with the measured one.

    .venv/bin/python bench/sim_calibrate.py [--requests 40] [--rate 2] [--seed 0] [--out DIR]

1. Timings: the tiny-llama engine (HFEngine, one torch thread, as the regions are run) timed
   in-process: prefill at several prompt lengths and decode steps at several contexts, each a
   median of repeats, fitted to the lines of `sim.calibration` -> DIR/timings.json.
2. The deployment (devstack/stack.py, real processes: API, Celery worker, a prefill region
   and a decode region, Redis): probe requests of fixed sizes, one at a time (no queueing):
   the fixed overhead outside the engines is the shortest probes' TTFT minus their engine
   time; each region's prefill line is fitted to its probes' TTFT (the prefill region's
   includes the layer-wise shipment) -> DIR/timings.json. The probes are not the workload.
3. The workload file (DIR/workload.jsonl: Poisson arrivals, prompt lengths log-uniform in
   16..3000 tokens, 8 output tokens) is sent open-loop with the official `openai` client,
   streaming; each row gets its measured `ttft_s` (first streamed token) -> DIR/measured.jsonl.
4. `sim.calibration.predict` on timings.json and the same rows: predicted vs measured TTFT P50.

Requests of at least `--split-tokens` uncached tokens split (prefill region -> decode region
over loopback TCP); shorter ones run locally in the decode region. Redis must run
(tests/ensure-services.sh). Every call has a timeout; processes are killed on exit.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai

from prfaas.devstack.stack import Stack, wait_until
from prfaas.engine.models import prepare_model
from prfaas.sim.calibration import Timings, fit_line, fit_prefill, predict_trace

MODEL = "tiny-llama"
CALL_TIMEOUT_S = 60.0
PROBE_SIZES = (4, 128, 384, 640, 900, 1000, 1500, 2000, 2500, 3000)  # prompt tokens of the probe requests
# the thresholds (low, high] that leave three probe sizes below (local) and three at or above (split)
SPLIT_RANGE = (sorted(PROBE_SIZES)[2], sorted(PROBE_SIZES)[-3])
PREFILL_PRICE, DECODE_PRICE = 0.5, 4.0  # $/GPU-hour the two regions announce (split is cheaper)


def time_engine(repeats: int) -> dict[str, Any]:
    """Median prefill seconds by prompt length and decode step seconds by context."""
    import torch

    from prfaas.engine.hf import HFEngine
    from prfaas.engine.sampling import SamplingParams

    torch.set_num_threads(1)  # a region process runs with OMP_NUM_THREADS=1 (devstack/stack.py)
    engine = HFEngine(MODEL)
    rng = random.Random(1)
    greedy = SamplingParams(max_new_tokens=9, temperature=0.0, ignore_eos=True)
    prefill: dict[int, float] = {}
    step: dict[int, float] = {}
    for n in (4, 64, 256, 1024, 2048, 3000):
        samples, steps = [], []
        for _ in range(repeats):
            prompt = [rng.randrange(5, 500) for _ in range(n)]
            start = time.perf_counter()
            result = engine.prefill(prompt, greedy)
            samples.append(time.perf_counter() - start)
            start = time.perf_counter()
            tokens = list(engine.decode(result.kv, result.first_token, greedy))
            steps.append((time.perf_counter() - start) / max(1, len(tokens)))
        prefill[n], step[n] = statistics.median(samples), statistics.median(steps)
    return {"prefill": prefill, "step": step, "num_layers": engine.num_layers,
            "kv_bytes_per_token": 2 * engine.num_layers * engine.num_kv_heads * engine.head_dim * 4}  # fmt: skip


def timings_from(
    engine: dict[str, Any], probes: list[dict[str, Any]], split_tokens: int
) -> tuple[Timings, dict[str, Any]]:
    """Per-region timings of the deployment, from probe requests sent one at a time:
    overhead = TTFT of the shortest local probes - the engine's own prefill (the first token
    is the prefill's: the region streams it before any decode step);
    each region's prefill line = its probes' TTFT - overhead (the prefill region's includes
    the layer-wise shipment and the decode region's hand-off)."""
    lengths = sorted(int(n) for n in engine["step"])
    d_base, d_slope = fit_line(lengths, [engine["step"][n] for n in lengths])
    shortest = min(p["prompt_tokens"] for p in probes)
    overhead = max(
        0.0,
        statistics.median(p["ttft_s"] for p in probes if p["prompt_tokens"] == shortest)
        - engine["prefill"][min(lengths)],
    )
    fits = {}
    for region, chosen in (("decode-b", [p for p in probes if p["prompt_tokens"] < split_tokens]),
                           ("prefill-a", [p for p in probes if p["prompt_tokens"] >= split_tokens])):  # fmt: skip
        sizes = sorted({p["prompt_tokens"] for p in chosen})
        medians = [statistics.median(p["ttft_s"] for p in chosen if p["prompt_tokens"] == n) for n in sizes]
        fits[region] = fit_prefill(sizes, [max(0.0, m - overhead) for m in medians]).model_dump()
    # the engine decodes one sequence at a time: a step of b sequences costs b single steps
    decode = {"base_s": 0.0, "per_seq_s": d_base, "per_ctx_token_s": d_slope}
    kv = engine["kv_bytes_per_token"]
    timings = Timings.model_validate(
        {
            "source": f"bench/sim_calibrate.py: {MODEL} on this host; prefill lines from probe requests "
            "through the real stack, decode step from the engine with 1 torch thread",
            "model": {"name": MODEL, "num_layers": engine["num_layers"], "kv_bytes_per_token": kv},
            "regions": [
                {"name": "prefill-a", "role": "prefill", "num_prefill_workers": 1, "prefill": fits["prefill-a"],
                 "usd_per_gpu_hour": PREFILL_PRICE},
                {"name": "decode-b", "role": "both", "num_prefill_workers": 1, "num_decode_workers": 1,
                 "prefill": fits["decode-b"], "decode": decode, "usd_per_gpu_hour": DECODE_PRICE},
            ],
            "links": [{"src": "prefill-a", "dst": "decode-b", "bandwidth_gbps": 10.0, "rtt_ms": 1.0}],
            "overhead_s": overhead,
            "min_uncached_tokens": split_tokens,
        }
    )  # fmt: skip
    return timings, {"overhead_s": overhead, "probes": probes}


def split_problem(split_tokens: int) -> str | None:
    """Why `timings_from` could not fit both regions' prefill lines at this threshold (None: it can): each needs
    probes of three sizes or more on its side (below the threshold local, at or above it split)."""
    low, high = SPLIT_RANGE
    if low < split_tokens <= high:
        return None
    return (
        f"--split-tokens {split_tokens}: the probes ({', '.join(map(str, sorted(PROBE_SIZES)))} tokens) need three "
        f"sizes on each side of the threshold to fit each region's prefill line; pick one in ({low}, {high}]"
    )


def workload(count: int, rate: float, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    rows, t = [], 0.0
    for _ in range(count):
        t += rng.expovariate(rate)
        prompt = round(16 * (3000 / 16) ** rng.random())
        rows.append({"t_s": round(t, 4), "prompt_tokens": prompt, "output_tokens": 8})
    return rows


def run_measured(stack: Stack, key: str, rows: list[dict[str, Any]], seed: int) -> list[dict[str, Any]]:
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key=key, max_retries=0, timeout=CALL_TIMEOUT_S)
    rng = random.Random(seed + 1)
    prompts = [[rng.randrange(5, 500) for _ in range(row["prompt_tokens"])] for row in rows]

    def send(i: int, at: float) -> dict[str, Any]:
        stream = client.completions.create(
            model=MODEL, prompt=prompts[i], max_tokens=rows[i]["output_tokens"], temperature=0.0, stream=True
        )
        first = None
        for _chunk in stream:
            if first is None:
                first = time.perf_counter() - at
        end = time.perf_counter() - at
        return {**rows[i], "ttft_s": first, "e2e_s": end}

    start = time.perf_counter() + 0.1
    with ThreadPoolExecutor(max_workers=64) as pool:
        futures = []
        for i, row in enumerate(rows):
            at = start + row["t_s"]
            delay = at - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            futures.append(pool.submit(send, i, at))
        return [f.result(timeout=CALL_TIMEOUT_S + 5) for f in futures]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--rate", type=float, default=1.0, help="requests/s (Poisson)")
    low, high = SPLIT_RANGE
    split_help = f"the deployment's disaggregation threshold, in ({low}, {high}]: three probe sizes each side"
    parser.add_argument("--split-tokens", type=int, default=1000, help=split_help)
    parser.add_argument("--repeats", type=int, default=3, help="timing repeats per size (engine and probes)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="folder for timings.json, workload.jsonl, measured.jsonl")
    args = parser.parse_args()
    problem = split_problem(args.split_tokens)
    if problem is not None:  # before the engine timing and the ~2 min of probes that would end in this
        parser.error(problem)
    # The regions must run the engine as it is timed here, on one torch thread: spawn_region's
    # default is OMP_NUM_THREADS=2, and two OpenMP threads per region on this 2-core host (both
    # regions, the API, the worker and everything else on it) made a split's prefill 5-15x
    # slower than timed (0.6-1.1 s for 1000 tokens vs 65 ms) and slowed the local requests
    # running beside it: the ~1.3 s "split path" of the earlier runs.
    os.environ["OMP_NUM_THREADS"] = "1"
    out = args.out or Path(tempfile.mkdtemp(prefix="sim-calibrate-"))
    out.mkdir(parents=True, exist_ok=True)
    prepare_model(MODEL)
    engine = time_engine(args.repeats)
    print("engine prefill s:", {n: round(s, 4) for n, s in engine["prefill"].items()})
    print("engine decode step s:", {n: round(s, 4) for n, s in engine["step"].items()})
    rows = workload(args.requests, args.rate, args.seed)
    (out / "workload.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    stack = Stack(out, min_split_tokens=args.split_tokens, PRFAAS_JOB_TIMEOUT_S=str(CALL_TIMEOUT_S))
    try:
        stack.start_api()
        stack.start_worker("calibrate", concurrency=8)
        stack.region("prefill-a", "prefill", PREFILL_PRICE)
        stack.region("decode-b", "decode", DECODE_PRICE)
        stack.put_link("prefill-a", "decode-b", rtt_ms=1.0, bandwidth_gbps=10.0)
        wait_until(lambda: len(stack.healthy()) == 2, 30, 0.1)
        _, key = stack.tenant("calibrate", rps=1e5, concurrency=10_000, budget_usd=1e9)
        run_measured(stack, key, [{"t_s": 0.2 * i, "prompt_tokens": 4, "output_tokens": 1} for i in range(5)], 0)
        probes: list[dict[str, Any]] = []
        for size in PROBE_SIZES:  # one at a time: no queueing in the probes
            for _ in range(args.repeats):
                probe = {"t_s": 0.0, "prompt_tokens": size, "output_tokens": 1}
                probes += run_measured(stack, key, [probe], len(probes))
        (out / "engine.json").write_text(json.dumps(engine, indent=2) + "\n")
        timings, fitted = timings_from(engine, probes, args.split_tokens)
        (out / "probes.json").write_text(json.dumps(fitted, indent=2) + "\n")
        (out / "timings.json").write_text(timings.model_dump_json(indent=2) + "\n")
        print(f"overhead outside the engines: {timings.overhead_s * 1000:.1f} ms")
        for region in timings.regions:
            print(f"{region.name} prefill fit: {region.prefill.model_dump()}")
        measured = run_measured(stack, key, rows, args.seed)
    finally:
        stack.stop()
        stack.cleanup()
    (out / "measured.jsonl").write_text("".join(json.dumps(r) + "\n" for r in measured))
    prediction = predict_trace(out / "timings.json", out / "measured.jsonl")  # the workload's rows, measured
    (out / "prediction.json").write_text(json.dumps(prediction.as_row(), indent=2, allow_nan=False) + "\n")
    print(f"files in {out}")
    for line in prediction.lines():
        print(line + (" (target within 20%)" if line.startswith("TTFT P50") else ""))


if __name__ == "__main__":
    main()
