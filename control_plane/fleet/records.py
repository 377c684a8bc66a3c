"""What the registry knows of a region and of each of its instances (records read from
Redis, fleet/registry.py). Pure: the aggregation over instances and the choice of the
instance new work goes to (`RegionRecord.pick`) need no I/O."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

DEFAULT_INSTANCE = "0"  # what an instance that names none registers as


class RegionNotFound(Exception):
    pass


@dataclass(frozen=True)
class InstanceRecord:
    """One instance of a region, as of its last heartbeat."""

    name: str  # the region's
    instance: str
    token: str  # what Register answered; heartbeats must carry it
    role: str
    gpu_type: str
    num_workers: int
    usd_per_gpu_hour: float
    grpc_endpoint: str
    kv_endpoint: str
    model: str
    model_fingerprint: str
    kv_buffer_bytes: int
    heartbeat_interval_s: float
    last_beat_at: float
    queue_depth: int
    busy_workers: int
    kv_used_bytes: int
    kv_free_bytes: int
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    draining: bool  # the instance says so (SIGTERM)
    drained: bool  # an operator drained its region
    alive: bool  # a beat within heartbeat_misses intervals
    heartbeat_age_s: float
    suspect: bool = False  # a call to it just failed UNAVAILABLE: no new work until that mark expires

    @property
    def key(self) -> str:
        return f"{self.name}/{self.instance}"

    @property
    def healthy(self) -> bool:
        return self.alive and not self.draining and not self.drained and not self.suspect

    @property
    def load(self) -> float:
        """Work waiting or running per worker: the instance a placement prefers has the least."""
        return (self.queue_depth + self.busy_workers) / max(1, self.num_workers)


@dataclass(frozen=True)
class RegionRecord:
    """A region over its instances: capacity and load summed over the healthy ones."""

    name: str
    role: str
    gpu_type: str
    usd_per_gpu_hour: float
    model: str
    instances: tuple[InstanceRecord, ...]  # by instance id
    drained: bool

    @staticmethod
    def of(instances: list[InstanceRecord]) -> RegionRecord:
        newest = max(instances, key=lambda i: i.last_beat_at)  # a region's facts as its latest registration says
        return RegionRecord(newest.name, newest.role, newest.gpu_type, newest.usd_per_gpu_hour, newest.model,
                            tuple(sorted(instances, key=lambda i: i.instance)), newest.drained)  # fmt: skip

    def _sum(self, field: str) -> Any:
        return sum(getattr(i, field) for i in self.instances if i.healthy)

    @property
    def healthy_instances(self) -> tuple[InstanceRecord, ...]:
        return tuple(i for i in self.instances if i.healthy)

    @property
    def alive(self) -> bool:
        return any(i.alive for i in self.instances)

    @property
    def healthy(self) -> bool:
        return bool(self.healthy_instances)

    @property
    def draining(self) -> bool:
        """Every live instance is stopping."""
        live = [i for i in self.instances if i.alive]
        return bool(live) and all(i.draining for i in live)

    @property
    def heartbeat_age_s(self) -> float:
        return min(i.heartbeat_age_s for i in self.instances)

    @property
    def num_workers(self) -> int:
        return int(self._sum("num_workers"))

    @property
    def queue_depth(self) -> int:
        return int(self._sum("queue_depth"))

    @property
    def busy_workers(self) -> int:
        return int(self._sum("busy_workers"))

    @property
    def kv_used_bytes(self) -> int:
        return int(self._sum("kv_used_bytes"))

    @property
    def kv_free_bytes(self) -> int:
        return int(self._sum("kv_free_bytes"))

    def _mean_rate(self, field: str) -> float:
        rates = [getattr(i, field) for i in self.healthy_instances if getattr(i, field) > 0]
        return sum(rates) / len(rates) if rates else 0.0

    @property
    def prefill_tokens_per_s(self) -> float:
        """One job's recent prefill rate (each instance measures its own; the mean of those)."""
        return self._mean_rate("prefill_tokens_per_s")

    @property
    def decode_tokens_per_s(self) -> float:
        """One request's recent decode rate (as prefill_tokens_per_s)."""
        return self._mean_rate("decode_tokens_per_s")

    def pick(self, exclude: frozenset[str] = frozenset()) -> InstanceRecord:
        """The healthy instance new work goes to: the least loaded, then the most KV room;
        RegionNotFound when none is left (all dead, draining or in `exclude`, by key)."""
        candidates = [i for i in self.healthy_instances if i.key not in exclude]
        if not candidates:
            raise RegionNotFound(f"region {self.name} has no healthy instance left")
        return min(candidates, key=lambda i: (i.load, -i.kv_free_bytes, i.instance))
