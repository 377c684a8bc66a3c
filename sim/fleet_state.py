"""The modelled fleet's live state during a simulation: each region's pools and the figures its heartbeat
would report, each link's flows; `snapshot_region` / `snapshot_link` give the scheduler what the control plane
would give it (rebuilt only when the state changed)."""

from __future__ import annotations

import math

import simpy

from prfaas.control_plane.scheduling import Link, Region, Role
from prfaas.sim.decode import DecodePool
from prfaas.sim.fleet import LinkSpec, RegionSpec
from prfaas.sim.hardware import WorkerTimings
from prfaas.sim.links import FluidLink
from prfaas.sim.prefix import PrefixModel

NOMINAL_BATCH = 64  # a worker's full batch when its model sets no max_batch


class RegionState:
    """One modelled region: its prefill workers (a FIFO resource), its decode pool, free KV buffer and the
    means a heartbeat would report."""

    def __init__(self, env: simpy.Environment, spec: RegionSpec, worker: WorkerTimings) -> None:
        self.spec = spec
        self.worker = worker
        self.prefill = simpy.Resource(env, capacity=spec.num_prefill_workers) if spec.num_prefill_workers else None
        self.decode = DecodePool(env, worker, spec.num_decode_workers)
        self.kv_capacity = worker.kv_capacity_bytes * spec.num_decode_workers
        self.kv_free = self.kv_capacity
        self.mean_prefill_s = 0.0
        self.mean_hold_s = 0.0  # shared slots: smoothed seconds a request holds one (as the decode region reports)
        self.queued_tokens = 0  # prompt tokens waiting for a prefill worker (what a heartbeat reports)
        self.running_tokens = 0  # prompt tokens being prefilled
        self.prefill_tps = worker.prefill_tokens_per_s()
        # What prices decode (Region.decode_nominal_tokens_per_s): a worker's tokens/s at its full
        # batch (max_batch, else NOMINAL_BATCH), the same however busy the region is now.
        full = worker.max_batch or NOMINAL_BATCH
        self.decode_nominal_tps = full / worker.decode_step_s(full, 0)
        self.prefill_busy_s = 0.0
        self.prefix = PrefixModel(spec.prefix_cache_blocks)
        self._cached: tuple[tuple[object, ...], Region] | None = None

    def snapshot_region(self) -> Region:
        """What this region's heartbeat would report now (rebuilt only when something changed)."""
        prefill = self.prefill
        key = (
            len(prefill.queue) if prefill else 0,
            prefill.count if prefill else 0,
            self.kv_free,
            self.decode.version,
            self.mean_prefill_s,
            self.queued_tokens,
            self.running_tokens,
            self.prefix.version,
            self.mean_hold_s,
        )
        if self._cached is not None and self._cached[0] == key:
            return self._cached[1]
        spec = self.spec
        num_workers = max(1, spec.num_prefill_workers)
        step = self.decode.step_with(extra_sequences=1)
        batch = max(1, math.ceil((self.decode.num_sequences + 1) / self.decode.num_workers))
        if self.worker.max_batch is not None:
            batch = min(batch, self.worker.max_batch)
        # Shared slots report what the live decode region does (control_plane/fleet/registry.py): its queue in
        # jobs, not tokens (a slot is held from the prefill to the last token, so queued and running prompt
        # tokens say nothing of the wait), and the mean time a job holds a slot as its mean prefill time.
        shared = spec.shared_workers
        # Built without validation: every field comes from this model, not from input.
        region = Region.model_construct(
            name=spec.name,
            role=role(spec),
            gpu_type=spec.gpu,
            num_gpus=num_workers * spec.gpus_per_worker,
            num_workers=num_workers,
            usd_per_gpu_hour=spec.price,
            spot_usd_per_gpu_hour=spec.spot_price,
            queue_depth=key[0] if prefill else 1,  # no prefill worker: reported as a full queue
            queue_capacity=None if prefill else 1,
            num_busy_workers=prefill.count if prefill else num_workers,
            mean_prefill_s=self.mean_hold_s if shared else self.mean_prefill_s,
            queued_prefill_tokens=None if shared else self.queued_tokens,
            running_prefill_tokens=self.running_tokens,
            decode_running=self.decode.num_sequences,
            decode_slots=self.decode.num_workers * (self.worker.max_batch or NOMINAL_BATCH),
            kv_buffer_free_bytes=self.kv_free,
            kv_buffer_bytes=self.kv_capacity,
            prefill_tokens_per_s=self.prefill_tps,
            decode_tokens_per_s=batch / step,
            tpot_ms=step * 1000.0,
            decode_nominal_tokens_per_s=self.decode_nominal_tps if spec.num_decode_workers else None,
            healthy=True,
            heartbeat_age_s=0.0,
            cached_prefix_hashes=self.prefix.resident,
        )
        self._cached = (key, region)
        return region

    def slot_released(self, held_s: float) -> None:
        """A shared slot was held `held_s` (from its job's prefill or hand-off to its last token): smoothed
        as the decode region's workers smooth it (decode_region/workers.py, the first job's as is)."""
        self.mean_hold_s = held_s if self.mean_hold_s == 0 else 0.8 * self.mean_hold_s + 0.2 * held_s


def role(spec: RegionSpec) -> Role:
    """The scheduler role of a modelled region: what its pools can do."""
    if not spec.num_decode_workers:
        return Role.PREFILL
    return Role.BOTH if spec.num_prefill_workers else Role.DECODE


class LinkState:
    """One modelled link: `pipe`, the fluid flow its shipments share (bytes carried, splits so far)."""

    def __init__(self, env: simpy.Environment, spec: LinkSpec, num_layers: int) -> None:
        self.spec = spec
        self.pipe = FluidLink(env, spec, num_layers)
        self._cached: tuple[int, Link] | None = None

    def snapshot_link(self) -> Link:
        """What a link probe would measure now: goodput, RTT, the share in use."""
        if self._cached is not None and self._cached[0] == self.pipe.version:
            return self._cached[1]
        link = Link.model_construct(
            src=self.spec.src,
            dst=self.spec.dst,
            rtt_ms=self.spec.rtt_ms,
            bandwidth_gbps=self.pipe.capacity * 8 / 1e9,
            utilization=self.pipe.utilization,
            egress_usd_per_gb=self.spec.egress_usd_per_gb,
        )
        self._cached = (self.pipe.version, link)
        return link
