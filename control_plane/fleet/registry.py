"""The region registry: regions `Register` and `Heartbeat` over gRPC (fleet/server.py); their
records live in Redis so every API process and Celery worker sees the same fleet. A region that
misses `heartbeat_misses` beats in a row is dead. Links (RTT, bandwidth, egress price) are
configured by operators through the admin API. `snapshot()` assembles the scheduler's frozen
`ClusterSnapshot` from all of it.

Keys (prefix `p`): `p:regions` set, `p:region:{name}` hash (registration, last load,
`last_beat_at`), `p:region:{name}:drained` flag, `p:links` hash `src>dst` -> JSON.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

import redis

from prfaas.control_plane.billing.prices import PriceBook, price_book
from prfaas.control_plane.scheduling.snapshot import ClusterSnapshot, Link, ModelShape, Region, Role
from prfaas.control_plane.settings import Settings
from prfaas.protos.prfaas.v1 import registry_pb2

FALLBACK_PREFILL_TPS = 2000.0  # tokens/s assumed until a region measures its own
FALLBACK_DECODE_TPS = 50.0


class RegionNotFound(Exception):
    pass


@dataclass(frozen=True)
class RegionRecord:
    name: str
    region_id: str
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
    draining: bool  # the region says so (SIGTERM)
    drained: bool  # an operator drained it
    alive: bool  # a beat within heartbeat_misses intervals
    heartbeat_age_s: float

    @property
    def healthy(self) -> bool:
        return self.alive and not self.draining and not self.drained


class RegionRegistry:
    def __init__(self, client: redis.Redis, settings: Settings) -> None:
        # redis-py types every reply as `Awaitable | Any` (one stub for sync and async clients)
        self.redis: Any = client
        self.settings = settings
        self.prices = price_book(
            client, settings.key("prices"), settings.prices.path
        )  # live/table prices override registered ones

    def _key(self, name: str) -> str:
        return self.settings.key("region", name)

    def register(self, request: registry_pb2.RegisterRequest) -> str:
        if not request.name or request.role not in ("prefill", "decode", "both"):
            raise ValueError("name is required and role must be prefill, decode or both")
        region_id = f"{request.name}-{uuid.uuid4().hex[:8]}"
        fields: dict[str, Any] = {
            "name": request.name, "region_id": region_id, "role": request.role, "gpu_type": request.gpu_type or "cpu",
            "num_workers": max(1, request.num_workers), "usd_per_gpu_hour": request.usd_per_gpu_hour,
            "grpc_endpoint": request.grpc_endpoint, "kv_endpoint": request.kv_endpoint, "model": request.model,
            "model_fingerprint": request.model_fingerprint, "kv_buffer_bytes": request.kv_buffer_bytes,
            "heartbeat_interval_s": request.heartbeat_interval_s or 1.0, "last_beat_at": time.time(),
            "queue_depth": 0, "busy_workers": 0, "kv_used_bytes": 0, "kv_free_bytes": request.kv_buffer_bytes,
            "prefill_tokens_per_s": 0.0, "decode_tokens_per_s": 0.0, "draining": 0,
        }  # fmt: skip
        with self.redis.pipeline() as pipe:
            pipe.delete(self._key(request.name))
            pipe.hset(self._key(request.name), mapping=fields)
            pipe.sadd(self.settings.key("regions"), request.name)
            pipe.execute()
        return region_id

    def heartbeat(self, request: registry_pb2.HeartbeatRequest) -> bool:
        """Record a beat; True when the region must register again (unknown or stale id)."""
        known = self.redis.hget(self._key(request.name), "region_id")
        if known is None or known.decode() != request.region_id:
            return True
        load = request.load
        self.redis.hset(
            self._key(request.name),
            mapping={
                "last_beat_at": time.time(), "queue_depth": load.queue_depth, "busy_workers": load.busy_workers,
                "kv_used_bytes": load.kv_used_bytes, "kv_free_bytes": load.kv_free_bytes,
                "prefill_tokens_per_s": load.prefill_tokens_per_s, "decode_tokens_per_s": load.decode_tokens_per_s,
                "draining": int(load.draining),
            },
        )  # fmt: skip
        return False

    def get(self, name: str, now: float | None = None) -> RegionRecord:
        with self.redis.pipeline() as pipe:
            pipe.hgetall(self._key(name))
            pipe.exists(self._key(name) + ":drained")
            raw, drained = pipe.execute()
        if not raw:
            raise RegionNotFound(name)
        return self._record(raw, bool(drained), time.time() if now is None else now)

    def _record(self, raw: dict[bytes, bytes], drained: bool, now: float) -> RegionRecord:
        f = {k.decode(): v.decode() for k, v in raw.items()}
        interval = float(f["heartbeat_interval_s"])
        age = max(0.0, now - float(f["last_beat_at"]))
        return RegionRecord(
            name=f["name"], region_id=f["region_id"], role=f["role"], gpu_type=f["gpu_type"],
            num_workers=int(f["num_workers"]), usd_per_gpu_hour=float(f["usd_per_gpu_hour"]),
            grpc_endpoint=f["grpc_endpoint"], kv_endpoint=f["kv_endpoint"], model=f["model"],
            model_fingerprint=f["model_fingerprint"], kv_buffer_bytes=int(f["kv_buffer_bytes"]),
            heartbeat_interval_s=interval, last_beat_at=float(f["last_beat_at"]),
            queue_depth=int(f["queue_depth"]), busy_workers=int(f["busy_workers"]),
            kv_used_bytes=int(f["kv_used_bytes"]), kv_free_bytes=int(f["kv_free_bytes"]),
            prefill_tokens_per_s=float(f["prefill_tokens_per_s"]), decode_tokens_per_s=float(f["decode_tokens_per_s"]),
            draining=f["draining"] == "1", drained=drained,
            alive=age <= self.settings.heartbeat_misses * interval, heartbeat_age_s=age,
        )  # fmt: skip

    def regions(self) -> list[RegionRecord]:
        """Every registered region, by name (two Redis round trips however many there are)."""
        names = sorted(m.decode() for m in self.redis.smembers(self.settings.key("regions")))
        with self.redis.pipeline(transaction=False) as pipe:
            for name in names:
                pipe.hgetall(self._key(name))
                pipe.exists(self._key(name) + ":drained")
            replies = pipe.execute()
        now = time.time()
        pairs = zip(replies[::2], replies[1::2], strict=True)
        return [self._record(raw, bool(drained), now) for raw, drained in pairs if raw]

    def set_drained(self, name: str, drained: bool) -> RegionRecord:
        self.get(name)
        if drained:
            self.redis.set(self._key(name) + ":drained", 1)
        else:
            self.redis.delete(self._key(name) + ":drained")
        return self.get(name)

    def set_link(self, link: Link) -> None:
        self.redis.hset(self.settings.key("links"), f"{link.src}>{link.dst}", link.model_dump_json())

    def delete_link(self, src: str, dst: str) -> bool:
        return bool(self.redis.hdel(self.settings.key("links"), f"{src}>{dst}"))

    def links(self) -> list[Link]:
        raw = self.redis.hgetall(self.settings.key("links"))
        return sorted((Link.model_validate(json.loads(v)) for v in raw.values()), key=lambda x: (x.src, x.dst))

    def snapshot(self, model: ModelShape, exclude: frozenset[str] = frozenset()) -> ClusterSnapshot:
        """The fleet as the scheduler sees it: regions serving `model`'s fingerprint-free name
        (dead, drained or excluded ones marked unhealthy) and the links between them."""
        return self.snapshot_of(self.regions(), self.links(), model, exclude)

    def snapshot_of(
        self, records: list[RegionRecord], links: list[Link], model: ModelShape, exclude: frozenset[str] = frozenset()
    ) -> ClusterSnapshot:
        regions = [self._region(r, exclude, self.prices) for r in records]
        names = {r.name for r in regions}
        kept = tuple(link for link in links if link.src in names and link.dst in names)
        return ClusterSnapshot(taken_at_s=time.time(), model=model, regions=tuple(regions), links=kept)

    @staticmethod
    def _region(r: RegionRecord, exclude: frozenset[str], prices: PriceBook) -> Region:
        decode_tps = r.decode_tokens_per_s or FALLBACK_DECODE_TPS
        on_demand = prices.on_demand(r.name)
        return Region(
            name=r.name, role=Role(r.role), gpu_type=r.gpu_type, num_gpus=r.num_workers, num_workers=r.num_workers,
            usd_per_gpu_hour=r.usd_per_gpu_hour if on_demand is None else on_demand,
            spot_usd_per_gpu_hour=prices.spot(r.name), queue_depth=r.queue_depth,
            num_busy_workers=min(r.busy_workers, r.num_workers),
            kv_buffer_free_bytes=r.kv_free_bytes if r.role != "prefill" else 0,
            prefill_tokens_per_s=r.prefill_tokens_per_s or FALLBACK_PREFILL_TPS, decode_tokens_per_s=decode_tps,
            tpot_ms=1000.0 / decode_tps, healthy=r.healthy and r.name not in exclude,
            heartbeat_age_s=r.heartbeat_age_s,
        )  # fmt: skip
