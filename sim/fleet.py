"""The modelled fleet: regions with GPU pools and prices, links, and the transport's figures.

A region has a prefill pool (PD clusters and prefill-only regions) and a decode pool (PD
clusters only); in-region prefill->decode KV moves over RDMA and is modelled as free. Links
are directed prefill region -> decode region paths over the WAN.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from prfaas.sim.hardware import GPUS, MODELS, ModelProfile, WorkerModel, WorkerTimings

# Measured by the KV transport (docs/benchmarks.md): wire bytes = raw / ratio, on bf16 KV.
CODEC_RATIOS: dict[str, float] = {
    "raw": 1.0,
    "lossless": 1.47,
    "int8": 2.19,
    "fp8": 2.43,
    "kv8": 2.25,
    "kv6": 2.63,
    "kv4": 4.22,
    "kvw6": 2.67,
    "kvw4": 4.17,
}
# Goodput / line rate of the adaptive multi-stream transport on clean or BBR paths: 0.88-0.95.
WIRE_EFFICIENCY = 0.90


@dataclass(frozen=True)
class RegionSpec:
    name: str
    gpu: str
    num_prefill_workers: int
    num_decode_workers: int = 0  # 0: a prefill-only region
    gpus_per_worker: int = 8
    usd_per_gpu_hour: float | None = None  # None: the GPU profile's price
    spot_usd_per_gpu_hour: float | None = None
    # the PD cluster's prefill and decode share one set of engine slots (num_prefill_workers of
    # them), each held by one request from its prefill (local) or hand-off (split) to its last
    # token: the local deployment's decode region (decode_region/agent.py, one slot per worker)
    shared_workers: bool = False
    # its engines' prefix cache, in blocks of the workload's block size (sim/prefix.py); 0: none modelled
    # (an arrival's own `cached_tokens` then says what its decode region holds)
    prefix_cache_blocks: int = 0

    def __post_init__(self) -> None:
        if self.gpu not in GPUS:
            raise ValueError(f"region {self.name}: unknown GPU {self.gpu!r}; known: {sorted(GPUS)}")
        if self.num_prefill_workers < 0 or self.num_decode_workers < 0:
            raise ValueError(
                f"region {self.name}: worker counts must be >= 0, got {self.num_prefill_workers} prefill, "
                f"{self.num_decode_workers} decode"
            )
        if self.gpus_per_worker < 1:
            raise ValueError(f"region {self.name}: gpus_per_worker must be >= 1, got {self.gpus_per_worker}")
        if self.num_prefill_workers < 1 and self.num_decode_workers < 1:
            raise ValueError(f"region {self.name} has no workers")
        if self.shared_workers and (self.num_prefill_workers < 1 or self.num_decode_workers < 1):
            raise ValueError(f"region {self.name}: shared workers need both prefill and decode")

    @property
    def price(self) -> float:
        return GPUS[self.gpu].usd_per_gpu_hour if self.usd_per_gpu_hour is None else self.usd_per_gpu_hour

    @property
    def spot_price(self) -> float | None:
        return (
            GPUS[self.gpu].spot_usd_per_gpu_hour if self.spot_usd_per_gpu_hour is None else self.spot_usd_per_gpu_hour
        )

    @property
    def num_gpus(self) -> int:
        # shared slots: the prefill and decode counts name the same engines, each counted once
        workers = (
            self.num_prefill_workers if self.shared_workers else self.num_prefill_workers + self.num_decode_workers
        )
        return workers * self.gpus_per_worker

    def worker(self, model: ModelProfile) -> WorkerModel:
        return WorkerModel(GPUS[self.gpu], model, self.gpus_per_worker)


@dataclass(frozen=True)
class LinkSpec:
    src: str
    dst: str
    bandwidth_gbps: float  # line rate, Gbit/s
    rtt_ms: float
    egress_usd_per_gb: float = 0.0
    efficiency: float = WIRE_EFFICIENCY

    def __post_init__(self) -> None:
        name = f"link {self.src}->{self.dst}"
        if self.src == self.dst:
            raise ValueError(f"{name}: a link joins two regions (in-region KV moves over RDMA, modelled as free)")
        if not (math.isfinite(self.bandwidth_gbps) and self.bandwidth_gbps >= 0):
            raise ValueError(f"{name}: bandwidth_gbps must be >= 0 (0: a dead link), got {self.bandwidth_gbps}")
        if not (math.isfinite(self.rtt_ms) and self.rtt_ms >= 0):
            raise ValueError(f"{name}: rtt_ms must be >= 0, got {self.rtt_ms}")
        if not 0 < self.efficiency <= 1:  # NaN fails too
            raise ValueError(f"{name}: efficiency (goodput / line rate) must be in (0, 1], got {self.efficiency}")
        if not (math.isfinite(self.egress_usd_per_gb) and self.egress_usd_per_gb >= 0):
            raise ValueError(f"{name}: egress_usd_per_gb must be >= 0, got {self.egress_usd_per_gb}")

    @property
    def goodput_bytes_per_s(self) -> float:
        return self.bandwidth_gbps * 1e9 / 8 * self.efficiency


@dataclass(frozen=True)
class FleetSpec:
    model: str
    regions: tuple[RegionSpec, ...]
    links: tuple[LinkSpec, ...] = field(default=())
    profile: ModelProfile | None = None  # a model outside `MODELS` (calibration: the deployment's own)
    # profiled timings per GPU type (one worker of that GPU serving this model) in place of the
    # roofline, e.g. `sim.profiles.PRFAAS_PROFILES`; GPU types not named here use the roofline
    timings: Mapping[str, WorkerTimings] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.profile is None and self.model not in MODELS:
            raise ValueError(f"unknown model {self.model!r}; known: {sorted(MODELS)}")
        names = {r.name for r in self.regions}
        if len(names) != len(self.regions):
            raise ValueError("region names repeat")
        for link in self.links:
            if link.src not in names or link.dst not in names:
                raise ValueError(f"link {link.src}->{link.dst} names an unknown region")

    @property
    def model_profile(self) -> ModelProfile:
        return self.profile or MODELS[self.model]

    @property
    def num_gpus(self) -> int:
        return sum(r.num_gpus for r in self.regions)

    def worker(self, region: RegionSpec) -> WorkerTimings:
        """One of `region`'s workers: its GPU type's profiled timings, else the roofline."""
        profiled = self.timings.get(region.gpu)
        return profiled if profiled is not None else region.worker(self.model_profile)
