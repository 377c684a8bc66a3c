"""The region registry. A region is a named pool of instances (an auto-scaling group's
machines, or one process on a laptop); each instance `Register`s and `Heartbeat`s over gRPC
(fleet/server.py) as (region, instance), with its own endpoints and load. Records live in
Redis so every API process and Celery worker sees the same fleet. An instance that misses
`heartbeat_misses` beats in a row is dead; one silent for `forget_after_s` is forgotten.

The scheduler sees regions (`snapshot()`: each region's capacity and load summed over its
healthy instances); a placement then runs on one instance of each chosen region (`pick`:
the least loaded healthy one), so an instance that joins or dies changes where new work
goes and nothing else. Links (RTT, bandwidth, egress price) between regions are configured
by operators through the admin API; the prefill regions' heartbeats report what their KV
senders measure on each path, and `links()` gives the configured links moved by those
measurements (fleet/links.py).

Keys (prefix `p`): `p:instances` set of `region/instance`, `p:instance:{region}/{instance}`
hash (registration, last load, `last_beat_at`), `p:suspect:{region}/{instance}` (a call to it
failed UNAVAILABLE; expires after `heartbeat_misses` intervals), `p:region:{name}:drained`
flag (an operator drained the region), `p:links` hash `src>dst` -> JSON (configured),
`p:link_estimates` hash `src>dst` -> JSON (measured, `LinkEstimate`).
"""

from __future__ import annotations

import hmac
import json
import logging
import math
import re
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, cast

import redis
from pydantic import ValidationError

from prfaas.control_plane.billing.prices import PriceBook, price_book
from prfaas.control_plane.fleet.links import LinkEstimate, effective, merged, stored_estimate
from prfaas.control_plane.fleet.records import DEFAULT_INSTANCE, InstanceRecord, RegionNotFound, RegionRecord
from prfaas.control_plane.scheduling.snapshot import (
    KV_DTYPE_BYTES,
    ClusterSnapshot,
    KVDtype,
    Link,
    ModelShape,
    Region,
    Role,
    kv_dtypes_alike,
)
from prfaas.control_plane.settings import Settings
from prfaas.protos.prfaas.v1 import registry_pb2
from prfaas.region.channels import MAX_PREFIX_BLOCKS
from prfaas.transport.identity import INSTANCE_ID, REGION_NAME

log = logging.getLogger(__name__)

FALLBACK_PREFILL_TPS = 2000.0  # tokens/s assumed until a region measures its own
FALLBACK_DECODE_TPS = 50.0
PARSED_BLOCKS_KEPT = 256  # instances' parsed prefix block sets kept (about 4 per instance)
FORGET_AFTER_BEATS = 60  # an instance silent this many intervals (at least 5 minutes) is forgotten
MAX_HEARTBEAT_INTERVAL_S = 60.0  # as a region's config allows: a longer one would keep a dead instance alive
MIN_RATE, MAX_RATE = 1e-3, 1e9  # tokens/s a region may report; outside: a broken meter, taken as unmeasured
MAX_LINKS_PER_BEAT = 256  # peer regions one beat may report on
MAX_JOB_S = 86400.0  # a worker's time per job a region may report; above (or not finite): unmeasured
ESTIMATE_KEPT_S = 3600.0  # a link estimate not refreshed for this long is deleted (ignored after STALE_S)
SHORT_DIGEST = re.compile(r"[0-9a-f]{16}")  # a published prefix block (engine/blocks.py `short`), fullmatch


class RegionRegistry:
    def __init__(
        self, client: redis.Redis, settings: Settings, served: Callable[[], str | None] = lambda: None
    ) -> None:
        """`served`: the served model's fingerprint (None: not known here); a region serving another is refused
        (it would answer local jobs with another model's tokens). Asked at the first registration."""
        # redis-py types every reply as `Awaitable | Any` (one stub for sync and async clients)
        self.redis: Any = client
        self.settings = settings
        self.served = served
        self.prices = price_book(
            client, settings.key("prices"), settings.prices.path
        )  # live/table prices override registered ones
        self._parsed_blocks: dict[tuple[str, ...], frozenset[str]] = {}

    def _key(self, name: str, instance: str) -> str:
        return self.settings.key("instance", f"{name}/{instance}")

    def _drained_key(self, name: str) -> str:
        return self.settings.key("region", name, "drained")

    def register(self, request: registry_pb2.RegisterRequest) -> str:
        """Record an instance (again, if it restarted); -> the token its heartbeats carry.
        ValueError for a bad registration, or one that contradicts the region's other live
        instances (another role or model: a region's instances are interchangeable)."""
        if not REGION_NAME.fullmatch(request.name) or request.role not in ("prefill", "decode", "both"):
            raise ValueError("name must be a region name (lowercase letters, digits, '-') and role prefill, "
                             "decode or both")  # fmt: skip
        instance = request.instance or DEFAULT_INSTANCE
        if not INSTANCE_ID.fullmatch(instance):
            raise ValueError(f"instance {instance[:64]!r} is not an instance id (letters, digits, '.', '_', '-')")
        if not (math.isfinite(request.usd_per_gpu_hour) and request.usd_per_gpu_hour >= 0):
            raise ValueError("usd_per_gpu_hour must be a finite number >= 0")
        interval = request.heartbeat_interval_s or 1.0
        if not 0 < interval <= MAX_HEARTBEAT_INTERVAL_S:  # NaN fails too
            raise ValueError(f"heartbeat_interval_s must be in (0, {MAX_HEARTBEAT_INTERVAL_S:g}] s")
        served = self.served()
        if served and request.model_fingerprint and request.model_fingerprint != served:
            raise ValueError(
                f"region {request.name} serves model {request.model or '?'} ({request.model_fingerprint[:16]}...); "
                f"this control plane serves {self.settings.model} ({served[:16]}...)"
            )
        for other in self.region_instances(request.name):
            if other.instance == instance or not other.alive:
                continue
            unlike = not kv_dtypes_alike(other.kv_dtype, request.kv_dtype)  # one that says none (older) is alike
            if (other.role, other.model_fingerprint) != (request.role, request.model_fingerprint) or unlike:
                raise ValueError(
                    f"instance {instance} of region {request.name} registers role {request.role}, model "
                    f"{request.model_fingerprint[:16]} and KV dtype {request.kv_dtype or '-'}; its instance "
                    f"{other.instance} serves {other.role}, {other.model_fingerprint[:16]}, {other.kv_dtype or '-'}"
                )
            if _webrtc(request.kv_endpoint) or _webrtc(other.kv_endpoint):
                # offers name the region (webrtc://<region>): whichever instance takes one gets the KV, reserved or not
                raise ValueError(
                    f"region {request.name} receives KV over WebRTC, whose offers name the region, not an instance: "
                    f"it may have one live instance, and {other.instance} is alive (instance {instance} may "
                    f"register once {other.instance} has missed {self.settings.heartbeat_misses} heartbeats)"
                )
        if request.kv_dtype and request.kv_dtype not in KV_DTYPE_BYTES:
            raise ValueError(f"kv_dtype {request.kv_dtype!r} is none of {', '.join(KV_DTYPE_BYTES)}")
        token = uuid.uuid4().hex[:16]
        fields: dict[str, Any] = {
            "name": request.name, "instance": instance, "token": token, "role": request.role,
            "gpu_type": request.gpu_type or "cpu", "num_workers": max(1, request.num_workers),
            "usd_per_gpu_hour": request.usd_per_gpu_hour, "grpc_endpoint": request.grpc_endpoint,
            "kv_endpoint": request.kv_endpoint, "model": request.model, "model_fingerprint": request.model_fingerprint,
            "kv_buffer_bytes": request.kv_buffer_bytes, "heartbeat_interval_s": interval,
            "last_beat_at": time.time(), "queue_depth": 0, "busy_workers": 0, "kv_used_bytes": 0,
            "kv_free_bytes": request.kv_buffer_bytes, "prefill_tokens_per_s": 0.0, "decode_tokens_per_s": 0.0,
            "draining": 0, "prefix_block_tokens": request.prefix_block_tokens, "prefix_version": -1, "prefix": "",
            "kv_dtype": request.kv_dtype, "queue_limit": request.queue_limit,
        }  # fmt: skip
        if request.prefix_block_tokens and request.prefix_block_tokens != self.settings.prefix.block_tokens:
            log.warning(
                "region %s caches prefix blocks of %d tokens, the control plane hashes prompts in blocks of %d: "
                "no prompt will match its cache (set its prefix_block_tokens)",
                request.name, request.prefix_block_tokens, self.settings.prefix.block_tokens,
            )  # fmt: skip
        key = self._key(request.name, instance)
        with self.redis.pipeline() as pipe:
            pipe.delete(key)
            pipe.hset(key, mapping=fields)
            pipe.sadd(self.settings.key("instances"), f"{request.name}/{instance}")
            pipe.execute()
        return token

    def heartbeat(self, request: registry_pb2.HeartbeatRequest) -> bool:
        """Record a beat; True when the instance must register again (unknown or stale token)."""
        key = self._key(request.name, request.instance or DEFAULT_INSTANCE)
        known = self.redis.hget(key, "token")
        if known is None or not hmac.compare_digest(known, request.region_id.encode()):
            return True
        load = request.load
        fields: dict[str, Any] = {
            "last_beat_at": time.time(), "queue_depth": load.queue_depth, "busy_workers": load.busy_workers,
            "kv_used_bytes": load.kv_used_bytes, "kv_free_bytes": load.kv_free_bytes,
            "prefill_tokens_per_s": _rate(load.prefill_tokens_per_s),
            "decode_tokens_per_s": _rate(load.decode_tokens_per_s), "draining": int(load.draining),
            "queued_prefill_tokens": load.queued_prefill_tokens, "running_prefill_tokens": load.running_prefill_tokens,
            "decode_running": load.decode_running, "decode_slots": load.decode_slots,
            "mean_job_s": load.mean_job_s if 0 <= load.mean_job_s <= MAX_JOB_S else 0.0,  # NaN fails
        }  # fmt: skip
        if load.prefix_included:  # a beat without them keeps the last ones sent
            # as many as a region publishes, each a short digest (a ',' in one would split it in two)
            blocks = [b for b in load.prefix_blocks[:MAX_PREFIX_BLOCKS] if SHORT_DIGEST.fullmatch(b)]
            fields |= {"prefix_version": load.prefix_version, "prefix": ",".join(blocks)}
        self.redis.hset(key, mapping=fields)
        if load.links:
            self._measured(request.name, load.links, request.instance or DEFAULT_INSTANCE)
        return False

    def _measured(self, src: str, reports: Sequence[registry_pb2.LinkReport], sender: str) -> None:
        """Fold a heartbeat's link reports into the estimates (read, update, write: two
        instances of one region beating at the same instant may lose one report, which the
        smoothing absorbs)."""
        key = self.settings.key("link_estimates")
        fields = sorted({f"{src}>{r.peer_region}" for r in reports if REGION_NAME.fullmatch(r.peer_region)})
        fields = fields[:MAX_LINKS_PER_BEAT]
        if not fields:
            return
        stored = dict(zip(fields, self.redis.hmget(key, fields), strict=True))
        estimates = {field: stored_estimate(raw, src, field.split(">", 1)[1]) for field, raw in stored.items()}
        by_peer: dict[str, list[registry_pb2.LinkReport]] = {}
        for report in reports:
            by_peer.setdefault(f"{src}>{report.peer_region}", []).append(report)
        for field in estimates:
            estimates[field] = estimates[field].updated(merged(by_peer[field]), sender=sender)
        self.redis.hset(key, mapping={field: e.model_dump_json() for field, e in estimates.items()})

    def link_estimates(self) -> dict[tuple[str, str], LinkEstimate]:
        """The measured links; one unreadable or not refreshed for ESTIMATE_KEPT_S is deleted here."""
        key = self.settings.key("link_estimates")
        estimates, dropped = {}, []
        for field, raw in self.redis.hgetall(key).items():
            try:
                e = LinkEstimate.model_validate_json(raw)
            except ValidationError:  # written by an older version, or by hand
                e = None
            if e is None or e.age_s() > ESTIMATE_KEPT_S:
                dropped.append(field)
            else:
                estimates[(e.src, e.dst)] = e
        if dropped:
            self.redis.hdel(key, *dropped)
        return estimates

    def instances(self) -> list[InstanceRecord]:
        """Every registered instance (two Redis round trips however many there are); those
        silent for FORGET_AFTER_BEATS intervals (at least 5 minutes) are forgotten here."""
        keys = sorted(m.decode() for m in self.redis.smembers(self.settings.key("instances")))
        regions = sorted({k.split("/", 1)[0] for k in keys})
        with self.redis.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.hgetall(self.settings.key("instance", key))
                pipe.exists(self.settings.key("suspect", key))
            for name in regions:
                pipe.exists(self._drained_key(name))
            replies = pipe.execute()
        drained = {name: bool(flag) for name, flag in zip(regions, replies[2 * len(keys) :], strict=True)}
        now = time.time()
        records, gone = [], []
        for key, raw, suspect in zip(keys, replies[: 2 * len(keys) : 2], replies[1 : 2 * len(keys) : 2], strict=True):
            try:
                record = (
                    self._record(raw, drained.get(key.split("/", 1)[0], False), now, bool(suspect)) if raw else None
                )
            except (KeyError, ValueError) as exc:  # a partial or foreign write: forgotten, it registers again
                log.warning("instance %s: unreadable record (%s); forgotten", key, exc)
                record = None
            if record is None or record.heartbeat_age_s > max(300.0, FORGET_AFTER_BEATS * record.heartbeat_interval_s):
                gone.append(key)
            else:
                records.append(record)
        if gone:
            self.redis.srem(self.settings.key("instances"), *gone)
            self.redis.delete(*(self.settings.key("instance", key) for key in gone))
        return records

    def region_instances(self, name: str) -> list[InstanceRecord]:
        return [i for i in self.instances() if i.name == name]

    def regions(self) -> list[RegionRecord]:
        """Every region with at least one known instance, by name."""
        by_name: dict[str, list[InstanceRecord]] = {}
        for record in self.instances():
            by_name.setdefault(record.name, []).append(record)
        return [RegionRecord.of(by_name[name]) for name in sorted(by_name)]

    def get(self, name: str) -> RegionRecord:
        instances = self.region_instances(name)
        if not instances:
            raise RegionNotFound(name)
        return RegionRecord.of(instances)

    def suspect(self, key: str) -> None:
        """An instance (`region/instance`) just refused a call: give it no new work for
        `heartbeat_misses` intervals (a dead one is declared dead by then; a live one is back)."""
        name, _, instance = key.partition("/")
        raw = self.redis.hget(self._key(name, instance), "heartbeat_interval_s")
        if raw is not None:
            ttl_ms = int(float(raw) * self.settings.heartbeat_misses * 1000)
            self.redis.set(self.settings.key("suspect", key), 1, px=max(100, ttl_ms))

    def _record(self, raw: dict[bytes, bytes], drained: bool, now: float, suspect: bool = False) -> InstanceRecord:
        f = {k.decode(): v.decode() for k, v in raw.items()}
        interval = float(f["heartbeat_interval_s"])
        age = max(0.0, now - float(f["last_beat_at"]))
        return InstanceRecord(
            name=f["name"], instance=f["instance"], token=f["token"], role=f["role"], gpu_type=f["gpu_type"],
            num_workers=int(f["num_workers"]), usd_per_gpu_hour=float(f["usd_per_gpu_hour"]),
            grpc_endpoint=f["grpc_endpoint"], kv_endpoint=f["kv_endpoint"], model=f["model"],
            model_fingerprint=f["model_fingerprint"], kv_buffer_bytes=int(f["kv_buffer_bytes"]),
            heartbeat_interval_s=interval, last_beat_at=float(f["last_beat_at"]),
            queue_depth=int(f["queue_depth"]), busy_workers=int(f["busy_workers"]),
            kv_used_bytes=int(f["kv_used_bytes"]), kv_free_bytes=int(f["kv_free_bytes"]),
            prefill_tokens_per_s=float(f["prefill_tokens_per_s"]), decode_tokens_per_s=float(f["decode_tokens_per_s"]),
            draining=f["draining"] == "1", drained=drained,
            alive=age <= self.settings.heartbeat_misses * interval, heartbeat_age_s=age, suspect=suspect,
            prefix_block_tokens=int(f.get("prefix_block_tokens", 0)), prefix_blocks=self._blocks(f),
            kv_dtype=f.get("kv_dtype", ""),
            queued_prefill_tokens=int(f.get("queued_prefill_tokens", 0)),
            running_prefill_tokens=int(f.get("running_prefill_tokens", 0)),
            decode_running=int(f.get("decode_running", 0)), decode_slots=int(f.get("decode_slots", 0)),
            mean_job_s=float(f.get("mean_job_s", 0.0)), queue_limit=int(f.get("queue_limit", 0)),
        )  # fmt: skip

    def _blocks(self, f: dict[str, str]) -> frozenset[str]:
        """An instance's published prefix blocks, parsed once per version it publishes."""
        raw = f.get("prefix", "")
        if not raw:
            return frozenset()
        key = (f["name"], f["instance"], f["token"], f.get("prefix_version", ""))
        parsed = self._parsed_blocks.get(key)
        if parsed is None:
            if len(self._parsed_blocks) > 4 * PARSED_BLOCKS_KEPT:
                self._parsed_blocks.clear()
            parsed = self._parsed_blocks[key] = frozenset(raw.split(","))
        return parsed

    def set_drained(self, name: str, drained: bool) -> RegionRecord:
        self.get(name)
        if drained:
            self.redis.set(self._drained_key(name), 1)
        else:
            self.redis.delete(self._drained_key(name))
        return self.get(name)

    def set_link(self, link: Link) -> None:
        self.redis.hset(self.settings.key("links"), f"{link.src}>{link.dst}", link.model_dump_json())

    def delete_link(self, src: str, dst: str) -> bool:
        return bool(self.redis.hdel(self.settings.key("links"), f"{src}>{dst}"))

    def configured_links(self) -> list[Link]:
        raw = self.redis.hgetall(self.settings.key("links"))
        return sorted((Link.model_validate(json.loads(v)) for v in raw.values()), key=lambda x: (x.src, x.dst))

    def links(self) -> list[Link]:
        """The configured links, moved by fresh measurements (fleet/links.py `effective`)."""
        if not self.settings.measure_links:
            return self.configured_links()
        estimates = self.link_estimates()
        return [effective(link, estimates.get((link.src, link.dst))) for link in self.configured_links()]

    def snapshot(self, model: ModelShape, exclude: frozenset[str] = frozenset()) -> ClusterSnapshot:
        """The fleet as the scheduler sees it: regions (dead, drained or excluded ones marked
        unhealthy) and the links between them. `exclude`: regions by name, or instances by
        `region/instance` key (a region is left out once none of its healthy instances is left)."""
        return self.snapshot_of(self.regions(), self.links(), model, exclude)

    def snapshot_of(
        self, records: list[RegionRecord], links: list[Link], model: ModelShape, exclude: frozenset[str] = frozenset()
    ) -> ClusterSnapshot:
        priors = _rate_priors(records)
        regions = []
        for r in records:
            try:
                regions.append(self._region(r, exclude, self.prices, priors.get(r.gpu_type, {})))
            except ValidationError as exc:  # one region's odd figures never stop placement in the others
                log.warning("region %s left out of the snapshot: %s", r.name, exc)
        names = {r.name for r in regions}
        kept = tuple(link for link in links if link.src in names and link.dst in names)
        return ClusterSnapshot(taken_at_s=time.time(), model=model, regions=tuple(regions), links=kept)

    @staticmethod
    def _region(r: RegionRecord, exclude: frozenset[str], prices: PriceBook, prior: dict[str, float]) -> Region:
        left = [i for i in r.healthy_instances if i.key not in exclude]
        if left and len(left) < len(r.healthy_instances):  # capacity, load and cache of what a retry may use
            r = RegionRecord.of([i for i in r.instances if i.key not in exclude])
        decode_tps = r.decode_tokens_per_s or prior.get("decode_tokens_per_s") or FALLBACK_DECODE_TPS
        prefill_tps = r.prefill_tokens_per_s or prior.get("prefill_tokens_per_s") or FALLBACK_PREFILL_TPS
        on_demand = prices.on_demand(r.name)
        workers = max(1, r.num_workers)
        return Region(
            name=r.name, role=Role(r.role), gpu_type=r.gpu_type, num_gpus=workers, num_workers=workers,
            usd_per_gpu_hour=r.usd_per_gpu_hour if on_demand is None else on_demand,
            spot_usd_per_gpu_hour=prices.spot(r.name), queue_depth=r.queue_depth,
            num_busy_workers=min(r.busy_workers, workers),
            kv_buffer_free_bytes=r.kv_free_bytes if r.role != "prefill" else 0,
            kv_buffer_bytes=r.kv_used_bytes + r.kv_free_bytes if r.role != "prefill" else 0,
            prefill_tokens_per_s=prefill_tps, decode_tokens_per_s=decode_tps,
            tpot_ms=1000.0 / decode_tps, healthy=bool(left) and r.name not in exclude,
            heartbeat_age_s=r.heartbeat_age_s, cached_prefix_hashes=r.prefix_blocks,
            # a decode region reports its queue in jobs (each holds a worker for its whole generation), not tokens
            queued_prefill_tokens=None if r.role == "decode" else r.queued_prefill_tokens,
            running_prefill_tokens=r.running_prefill_tokens, mean_prefill_s=r.mean_job_s,
            queue_capacity=r.queue_limit or None,  # its instances' together
            decode_running=r.decode_running, decode_slots=r.decode_slots,
            kv_dtype=cast(KVDtype | None, r.kv_dtype or None),  # checked at registration
        )  # fmt: skip


def _webrtc(kv_endpoint: str) -> bool:
    return any(part.strip().startswith("webrtc://") for part in kv_endpoint.split(","))


def _rate(value: float) -> float:
    """A reported rate, or 0 (unmeasured) when it is not one a region can reach."""
    return value if MIN_RATE <= value <= MAX_RATE else 0.0  # NaN fails both


def _rate_priors(records: list[RegionRecord]) -> dict[str, dict[str, float]]:
    """Per GPU type, the mean rates the regions that measured them report: what a region that
    has run no job yet is assumed to reach. A fixed low fallback would make it look slower and
    dearer than every measured region, so it would never get the job that measures it."""
    sums: dict[str, dict[str, list[float]]] = {}
    for r in records:
        for field in ("prefill_tokens_per_s", "decode_tokens_per_s"):
            if getattr(r, field):
                sums.setdefault(r.gpu_type, {}).setdefault(field, []).append(getattr(r, field))
    return {gpu: {field: sum(v) / len(v) for field, v in fields.items()} for gpu, fields in sums.items()}
