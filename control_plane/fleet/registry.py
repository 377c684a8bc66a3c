"""The region registry. A region is a named pool of instances (an auto-scaling group's
machines, or one process on a laptop); each instance `Register`s and `Heartbeat`s over gRPC
(fleet/server.py) as (region, instance), with its own endpoints and load. Records live in
Redis so every API process and Celery worker sees the same fleet. An instance that misses
`heartbeat_misses` beats in a row is dead; one silent for `forget_after_s` is forgotten.

The scheduler sees regions (`snapshot()`, built by fleet/snapshots.py: each region's capacity
and load summed over its healthy instances); a placement then runs on one instance of each
chosen region (`pick`: one with room for the KV, holding most of the prompt, the least loaded),
so an instance that joins or dies changes where new work goes and nothing else. Links (RTT,
bandwidth, egress price) between regions are configured by operators through the admin API;
the prefill regions' heartbeats report what their KV senders measure on each path, and
`links()` gives the configured links moved by those measurements (fleet/links.py).

Keys (prefix `p`): `p:instances` set of `region/instance`, `p:instance:{region}/{instance}`
hash (registration with `registered_at`, last load, `last_beat_at`: both on Redis's clock,
TIME, as every reader ages them), `p:suspect:{region}/{instance}` (a call to it
failed UNAVAILABLE; expires after `heartbeat_misses` intervals), `p:region:{name}:drained`
flag (an operator drained the region), `p:links` hash `src>dst` -> JSON (configured),
`p:link_estimates` hash `src>dst` -> JSON (measured, `LinkEstimate`).
"""

from __future__ import annotations

import hmac
import logging
import math
import re
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import redis
from pydantic import ValidationError
from sqlalchemy.engine import Engine

from prfaas.control_plane.billing.prices import price_book
from prfaas.control_plane.fleet.link_rows import LinkBook
from prfaas.control_plane.fleet.links import LinkEstimate, effective, merged, stored_estimate
from prfaas.control_plane.fleet.records import DEFAULT_INSTANCE, InstanceRecord, RegionNotFound, RegionRecord
from prfaas.control_plane.fleet.snapshots import snapshot_of
from prfaas.control_plane.scheduling.plugin_registry import validation_message
from prfaas.control_plane.scheduling.snapshot import KV_DTYPE_BYTES, ClusterSnapshot, Link, ModelShape, kv_dtypes_alike
from prfaas.control_plane.settings import Settings
from prfaas.protos.prfaas.v1 import registry_pb2
from prfaas.region.channels import MAX_PREFIX_BLOCKS
from prfaas.transport.identity import INSTANCE_ID, REGION_NAME

log = logging.getLogger(__name__)

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
        self, client: redis.Redis, settings: Settings, served: Callable[[], str | None] = lambda: None,
        database: Engine | None = None,
    ) -> None:  # fmt: skip
        """`served`: the served model's fingerprint (None: not known here); a region serving another is refused
        (it would answer local jobs with another model's tokens). Asked at the first registration. `database`:
        where the operator-set links are kept (fleet/link_rows.py; None: in Redis alone)."""
        # redis-py types every reply as `Awaitable | Any` (one stub for sync and async clients)
        self.redis: Any = client
        self.settings = settings
        self.served = served
        self.prices = price_book(
            client, settings.key("prices"), settings.prices.path
        )  # live/table prices override registered ones
        self._parsed_blocks: dict[tuple[str, ...], frozenset[str]] = {}
        self.link_book = LinkBook(client, settings.key("links"), database)

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
        token, now = uuid.uuid4().hex[:16], self.clock()
        fields: dict[str, Any] = {
            "name": request.name, "instance": instance, "token": token, "role": request.role,
            "gpu_type": request.gpu_type or "cpu", "num_workers": max(1, request.num_workers),
            "usd_per_gpu_hour": request.usd_per_gpu_hour, "grpc_endpoint": request.grpc_endpoint,
            "kv_endpoint": request.kv_endpoint, "model": request.model, "model_fingerprint": request.model_fingerprint,
            "kv_buffer_bytes": request.kv_buffer_bytes, "heartbeat_interval_s": interval,
            "last_beat_at": now, "registered_at": now, "queue_depth": 0, "busy_workers": 0, "kv_used_bytes": 0,
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
        with self.redis.pipeline(transaction=False) as pipe:
            pipe.hget(key, "token")
            pipe.time()
            known, clock = pipe.execute()
        now = _seconds(clock)
        if known is None or not hmac.compare_digest(known, request.region_id.encode()):
            return True
        load = request.load
        fields: dict[str, Any] = {
            "last_beat_at": now, "queue_depth": load.queue_depth, "busy_workers": load.busy_workers,
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
            self._measured(request.name, load.links, request.instance or DEFAULT_INSTANCE, now)
        return False

    def clock(self) -> float:
        """Now, s since the epoch, on Redis's clock (TIME). Beats are stamped and aged on it, not on the hosts':
        an API process whose clock ran 4 s ahead of the one that took a 1 s-interval region's beat found it
        dead (and one behind kept a dead region alive)."""
        return _seconds(self.redis.time())

    def _measured(self, src: str, reports: Sequence[registry_pb2.LinkReport], sender: str, now: float) -> None:
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
            estimates[field] = estimates[field].updated(merged(by_peer[field]), now, sender)
        self.redis.hset(key, mapping={field: e.model_dump_json() for field, e in estimates.items()})

    def link_estimates(self, now: float | None = None) -> dict[tuple[str, str], LinkEstimate]:
        """The measured links; one unreadable or not refreshed for ESTIMATE_KEPT_S is deleted here. `now`:
        Redis's clock (read here when not given), which the estimates are stamped on."""
        key = self.settings.key("link_estimates")
        now = self.clock() if now is None else now
        estimates, dropped = {}, []
        for field, raw in self.redis.hgetall(key).items():
            try:
                e = LinkEstimate.model_validate_json(raw)
            except ValidationError:  # written by an older version, or by hand
                e = None
            if e is None or e.age_s(now) > ESTIMATE_KEPT_S:
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
            pipe.time()  # beats are aged on the clock they were stamped on (`clock`)
            *replies, clock = pipe.execute()
        drained = {name: bool(flag) for name, flag in zip(regions, replies[2 * len(keys) :], strict=True)}
        now = _seconds(clock)
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
            registered_at=float(f.get("registered_at", 0.0)),
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
        self.link_book.set(link)

    def delete_link(self, src: str, dst: str) -> bool:
        return self.link_book.delete(src, dst)

    def configured_links(self) -> list[Link]:
        """The links operators configured; one stored that does not validate (written before a bound was added,
        by a newer version or by hand) is logged and left out: it would fail every snapshot, every placement."""
        links = []
        for field, raw in self.link_book.stored().items():
            try:
                links.append(Link.model_validate_json(raw))
            except ValidationError as exc:  # not JSON, too
                name = field.decode(errors="replace") if isinstance(field, bytes) else field
                log.warning("configured link %s left out: %s: %s", name, *validation_message(exc))
        return sorted(links, key=lambda x: (x.src, x.dst))

    def links(self) -> list[Link]:
        """The configured links, moved by fresh measurements (fleet/links.py `effective`)."""
        if not self.settings.measure_links:
            return self.configured_links()
        now = self.clock()
        estimates = self.link_estimates(now)
        return [effective(link, estimates.get((link.src, link.dst)), now) for link in self.configured_links()]

    def snapshot(self, model: ModelShape, exclude: frozenset[str] = frozenset()) -> ClusterSnapshot:
        """The fleet as the scheduler sees it: regions (dead, drained or excluded ones marked
        unhealthy) and the links between them. `exclude`: regions by name, or instances by
        `region/instance@t` entry, an incarnation (`InstanceRecord.excluded_by`; a region is left out once none
        of its healthy instances is left)."""
        return self.snapshot_of(self.regions(), self.links(), model, exclude)

    def snapshot_of(
        self, records: list[RegionRecord], links: list[Link], model: ModelShape, exclude: frozenset[str] = frozenset()
    ) -> ClusterSnapshot:
        return snapshot_of(records, links, model, self.prices, exclude)


def _webrtc(kv_endpoint: str) -> bool:
    return any(part.strip().startswith("webrtc://") for part in kv_endpoint.split(","))


def _seconds(clock: tuple[int, int]) -> float:
    """Redis's TIME reply (seconds, microseconds) in seconds."""
    return clock[0] + clock[1] / 1e6


def _rate(value: float) -> float:
    """A reported rate, or 0 (unmeasured) when it is not one a region can reach."""
    return value if MIN_RATE <= value <= MAX_RATE else 0.0  # NaN fails both
