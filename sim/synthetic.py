"""Deterministic synthetic fleets and requests, for scheduler latency measurements
(`bench/scheduler.py`), the scheduler's property tests and simulator smoke runs. Same seed,
same fleet. Random figures, not a model of any fleet (`fleet.py` models one).

Links: each decode-capable region has up to `links_per_region` measured inbound links from
prefill-capable regions (a fleet measures the paths it uses, not all N^2 pairs).
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

from prfaas.control_plane.scheduling import (
    ClusterSnapshot,
    GlobalScheduler,
    Link,
    ModelShape,
    PlacementRejected,
    Priority,
    Region,
    Request,
    Role,
    Slo,
)
from prfaas.sim.experiment import percentile


@dataclass(frozen=True)
class GpuProfile:
    gpu_type: str
    usd_per_gpu_hour: float
    spot_usd_per_gpu_hour: float | None
    prefill_tokens_per_s: float  # one 8-GPU worker
    decode_tokens_per_s: float
    tpot_ms: float


GPU_PROFILES = (
    GpuProfile("H200", 6.0, None, 60_000.0, 9_000.0, 25.0),
    GpuProfile("H100", 4.5, 2.2, 45_000.0, 6_500.0, 30.0),
    GpuProfile("H20", 1.9, 0.9, 15_000.0, 5_500.0, 35.0),
    GpuProfile("L40S", 1.2, 0.6, 12_000.0, 2_000.0, 60.0),
)
SYSTEM_PROMPTS = 8
SYSTEM_PROMPT_BLOCKS = 512  # 8,192 tokens at 16 tokens per block
DEFAULT_MODEL = ModelShape(name="synthetic-32b", num_layers=64, kv_bytes_per_token=131_072)


def _prompt_hashes(prompt: int, num_blocks: int) -> tuple[str, ...]:
    return tuple(f"sys{prompt}-b{block}" for block in range(num_blocks))


def synthetic_snapshot(
    num_regions: int,
    num_workers: int,
    *,
    seed: int = 0,
    links_per_region: int = 16,
    model: ModelShape = DEFAULT_MODEL,
) -> ClusterSnapshot:
    """`num_regions` regions sharing `num_workers` 8-GPU workers (at least one each)."""
    if num_regions < 2:
        raise ValueError("a synthetic fleet needs at least 2 regions")
    rng = random.Random(seed)
    regions: list[Region] = []
    for i in range(num_regions):
        role = (Role.DECODE, Role.PREFILL)[i % 2] if i < 2 else rng.choice((Role.PREFILL, Role.DECODE, Role.BOTH))
        gpu = rng.choice(GPU_PROFILES[2:] if role is Role.PREFILL else GPU_PROFILES)
        workers = max(1, num_workers // num_regions + (1 if i < num_workers % num_regions else 0))
        busy = rng.randint(0, workers)
        cached = frozenset(
            h for p in range(SYSTEM_PROMPTS) if rng.random() < 0.3 for h in _prompt_hashes(p, SYSTEM_PROMPT_BLOCKS)
        )
        regions.append(
            Region(
                name=f"r{i:04d}",
                role=role,
                gpu_type=gpu.gpu_type,
                num_gpus=8 * workers,
                num_workers=workers,
                usd_per_gpu_hour=gpu.usd_per_gpu_hour * rng.uniform(0.8, 1.2),
                spot_usd_per_gpu_hour=gpu.spot_usd_per_gpu_hour,
                queue_depth=rng.randint(0, 3 * workers) if busy == workers else 0,
                queue_capacity=16 * workers,
                num_busy_workers=busy,
                mean_prefill_s=rng.uniform(0.2, 2.0),
                kv_buffer_free_bytes=rng.randint(0, 400) * 2**30,
                prefill_tokens_per_s=gpu.prefill_tokens_per_s * rng.uniform(0.9, 1.1),
                decode_tokens_per_s=gpu.decode_tokens_per_s * rng.uniform(0.9, 1.1),
                tpot_ms=gpu.tpot_ms * rng.uniform(0.9, 1.4),
                healthy=rng.random() > 0.03,
                heartbeat_age_s=rng.choice((1.0, 2.0, 4.0, 40.0)) if rng.random() < 0.1 else 1.0,
                cached_prefix_hashes=cached,
            )
        )
    sources = [r.name for r in regions if r.can_serve_split_prefill]
    links: list[Link] = []
    for region in regions:
        if not region.can_decode:
            continue
        others = [name for name in sources if name != region.name]
        for src in rng.sample(others, min(links_per_region, len(others))):
            links.append(
                Link(
                    src=src,
                    dst=region.name,
                    rtt_ms=rng.uniform(5.0, 150.0),
                    bandwidth_gbps=rng.choice((10.0, 25.0, 40.0, 100.0)),
                    utilization=rng.uniform(0.0, 0.97),
                    egress_usd_per_gb=rng.choice((0.0, 0.01, 0.02, 0.05)),
                )
            )
    return ClusterSnapshot(taken_at_s=1.7e9, model=model, regions=tuple(regions), links=tuple(links))


def synthetic_requests(snapshot: ClusterSnapshot, count: int, *, seed: int = 0) -> list[Request]:
    """Prompts log-uniform in [64, 128K] tokens, some opening with a shared system prompt,
    some with residency limits, a few high priority."""
    rng = random.Random(seed)
    names = [r.name for r in snapshot.regions]
    requests: list[Request] = []
    for i in range(count):
        prompt = int(2 ** rng.uniform(6, 17))
        blocks = _prompt_hashes(rng.randrange(SYSTEM_PROMPTS), min(SYSTEM_PROMPT_BLOCKS, prompt // 16))
        allowed = frozenset(rng.sample(names, max(1, len(names) // 2))) if rng.random() < 0.2 else None
        requests.append(
            Request(
                request_id=f"q{i}",
                tenant=f"tenant{i % 7}",
                prompt_tokens=prompt,
                max_new_tokens=rng.randint(16, 1024),
                slo=Slo(ttft_ms=rng.choice((1_000.0, 3_000.0, 10_000.0)), tpot_ms=rng.choice((40.0, 60.0, 100.0))),
                prefix_block_hashes=blocks if rng.random() < 0.5 else (),
                allowed_regions=allowed,
                priority=Priority.HIGH if rng.random() < 0.1 else Priority.NORMAL,
                allow_lossy_codec=rng.random() < 0.3,
            )
        )
    return requests


def decision_latencies_ms(
    scheduler: GlobalScheduler, snapshot: ClusterSnapshot, requests: Sequence[Request]
) -> list[float]:
    """Wall time of each `decide` call, ms, rejections included (they are decisions too)."""
    out: list[float] = []
    for request in requests:
        start = time.perf_counter()
        with contextlib.suppress(PlacementRejected):
            scheduler.decide(snapshot, request)
        out.append((time.perf_counter() - start) * 1000.0)
    return out


def latency_rows(
    scheduler: GlobalScheduler,
    region_counts: Sequence[int] = (10, 100, 1_000),
    *,
    num_workers: int = 1_000,
    num_requests: int = 2_000,
    seed: int = 0,
) -> list[dict[str, float]]:
    """Decision latency per fleet size: rows of `regions`, `p50_ms`, `p99_ms` (what
    `bench/scheduler.py --json` writes). A warm-up pass over the first tenth comes first."""
    rows: list[dict[str, float]] = []
    for count in region_counts:
        snapshot = synthetic_snapshot(count, num_workers, seed=seed)
        requests = synthetic_requests(snapshot, num_requests, seed=seed + 1)
        decision_latencies_ms(scheduler, snapshot, requests[: max(1, num_requests // 10)])
        latencies = decision_latencies_ms(scheduler, snapshot, requests)
        rows.append({"regions": count, "p50_ms": percentile(latencies, 50), "p99_ms": percentile(latencies, 99)})
    return rows
