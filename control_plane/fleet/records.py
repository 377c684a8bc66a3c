"""What the registry knows of a region and of each of its instances (records read from
Redis, fleet/registry.py). Pure: the aggregation over instances and the choice of the
instance new work goes to (`RegionRecord.pick`) need no I/O."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

DEFAULT_INSTANCE = "0"  # what an instance that names none registers as
INCARNATION = "@"  # in a job's `excluded` entry, `region/instance@t`: no region name or instance id holds it


class RegionNotFound(Exception):
    pass


@dataclass(frozen=True, kw_only=True)
class Load:
    """Health and load as of the last heartbeat: an instance's, or a region's over its instances."""

    alive: bool  # a beat within heartbeat_misses intervals (a region: of an instance)
    draining: bool  # stopping, SIGTERM (a region: every live instance)
    heartbeat_age_s: float  # since the last beat (a region: its most recent)
    num_workers: int
    queue_depth: int
    busy_workers: int
    kv_used_bytes: int
    kv_free_bytes: int
    prefill_tokens_per_s: float  # one job's recent rate
    decode_tokens_per_s: float
    queued_prefill_tokens: int = 0  # prompts admitted, not started
    running_prefill_tokens: int = 0  # prompts being computed
    decode_running: int = 0  # sequences decoding
    decode_slots: int = 0  # sequences it decodes at once at most
    mean_job_s: float = 0.0  # a worker's recent time per job (a decode region's; 0: none measured)
    queue_limit: int = 0  # prefill jobs it queues beyond its workers (0: no limit known)


@dataclass(frozen=True, kw_only=True)
class InstanceRecord(Load):
    """One instance of a region, as of its last heartbeat."""

    name: str  # the region's
    instance: str
    token: str  # what Register answered; heartbeats must carry it
    role: str
    gpu_type: str
    usd_per_gpu_hour: float
    grpc_endpoint: str
    kv_endpoint: str
    model: str
    model_fingerprint: str
    kv_buffer_bytes: int
    heartbeat_interval_s: float
    last_beat_at: float  # s since the epoch, on Redis's clock (TIME): every reader ages it on the same clock
    drained: bool  # an operator drained its region
    registered_at: float = 0.0  # when it last registered, Redis's clock (0: a record written before the field)
    suspect: bool = False  # a call to it just failed UNAVAILABLE: no new work until that mark expires
    prefix_block_tokens: int = 0  # its prefix cache's block size; 0: none
    prefix_blocks: frozenset[str] = frozenset()  # short digests of the prompt blocks its prefix cache holds
    kv_dtype: str = ""  # its engine's KV dtype ("" from a region that does not say: the model's figure applies)

    @property
    def key(self) -> str:
        return f"{self.name}/{self.instance}"

    def excluded_by(self, exclude: frozenset[str]) -> bool:
        """Whether a job's `excluded` entries leave this incarnation out: `region/instance@t` (`exclusion`)
        the incarnations registered by `t`, Redis's clock (the one that failed, not one that registered
        again since: a restart keeps the instance id); a plain `region/instance` (an entry written before
        incarnations were told apart) all of them."""
        if not exclude:
            return False
        if self.key in exclude:
            return True
        prefix = self.key + INCARNATION
        return any(e.startswith(prefix) and self.registered_at <= _failed_at(e[len(prefix) :]) for e in exclude)

    @property
    def healthy(self) -> bool:
        return self.alive and not self.draining and not self.drained and not self.suspect

    @property
    def load(self) -> float:
        """Work waiting or running per worker: the instance a placement prefers has the least."""
        return (self.queue_depth + self.busy_workers) / max(1, self.num_workers)


SUMMED = (  # over healthy instances
    "num_workers", "queue_depth", "busy_workers", "kv_used_bytes", "kv_free_bytes", "queued_prefill_tokens",
    "running_prefill_tokens", "decode_running", "decode_slots", "queue_limit",
)  # fmt: skip
RATES = ("prefill_tokens_per_s", "decode_tokens_per_s", "mean_job_s")  # one job's: the mean of those measured


@dataclass(frozen=True, kw_only=True)
class RegionRecord(Load):
    """A region over its instances: capacity and load summed over the healthy ones (`of`)."""

    name: str
    role: str
    gpu_type: str
    usd_per_gpu_hour: float
    model: str
    instances: tuple[InstanceRecord, ...]  # by instance id
    drained: bool
    prefix_blocks: frozenset[str] = frozenset()  # held by any healthy instance
    kv_dtype: str = ""  # as its latest registration says (its instances agree: fleet/registry.py)
    kv_largest_free_bytes: int = 0  # the most free in one healthy instance: the largest reservation it takes
    heartbeat_interval_s: float = 0.0  # the longest its live instances beat at (all of them when none is live)

    @staticmethod
    def of(instances: list[InstanceRecord]) -> RegionRecord:
        healthy = [i for i in instances if i.healthy]
        live = [i for i in instances if i.alive]
        # a region's facts (price, GPU type, role) as its latest registration says, a live one's if any: by
        # last beat, they flipped with every beat between instances registered with different prices
        newest = max(live or instances, key=lambda i: (i.registered_at, i.instance))
        totals: dict[str, Any] = {field: sum(getattr(i, field) for i in healthy) for field in SUMMED}
        for field in RATES:
            rates = [getattr(i, field) for i in healthy if getattr(i, field) > 0]
            totals[field] = sum(rates) / len(rates) if rates else 0.0
        return RegionRecord(
            name=newest.name, role=newest.role, gpu_type=newest.gpu_type, usd_per_gpu_hour=newest.usd_per_gpu_hour,
            model=newest.model, instances=tuple(sorted(instances, key=lambda i: i.instance)), drained=newest.drained,
            alive=bool(live), draining=bool(live) and all(i.draining for i in live),
            heartbeat_age_s=min(i.heartbeat_age_s for i in instances),
            prefix_blocks=frozenset().union(*(i.prefix_blocks for i in healthy)), kv_dtype=newest.kv_dtype,
            kv_largest_free_bytes=max((i.kv_free_bytes for i in healthy), default=0),
            heartbeat_interval_s=max(i.heartbeat_interval_s for i in live or instances),
            **totals,
        )  # fmt: skip

    @property
    def healthy_instances(self) -> tuple[InstanceRecord, ...]:
        return tuple(i for i in self.instances if i.healthy)

    @property
    def healthy(self) -> bool:
        return bool(self.healthy_instances)

    def instance(self, name: str) -> InstanceRecord:
        """The live instance `name` (RegionNotFound if it is gone or dead)."""
        for i in self.instances:
            if i.instance == name and i.alive:
                return i
        raise RegionNotFound(f"instance {self.name}/{name} is not alive")

    def pick(
        self, exclude: frozenset[str] = frozenset(), prefix: tuple[str, ...] = (), kv_bytes: int = 0
    ) -> InstanceRecord:
        """The healthy instance new work goes to: of those whose free KV buffer holds `kv_bytes` (the
        reservation a decode instance takes; all of them when none does), the one holding the longest
        run of the prompt's leading blocks (`prefix`, short digests), then the least loaded, then the
        most KV room; RegionNotFound when none is left (all dead, draining or in `exclude`: `excluded_by`)."""
        candidates = [i for i in self.healthy_instances if not i.excluded_by(exclude)]
        if not candidates:
            raise RegionNotFound(f"region {self.name} has no healthy instance left")
        fit = [i for i in candidates if i.kv_free_bytes >= kv_bytes]  # a prefix hit is no use where it is refused
        return min(fit or candidates, key=lambda i: (-cached_run(prefix, i.prefix_blocks), i.load, -i.kv_free_bytes,
                                                     i.instance))  # fmt: skip


def exclusion(key: str, failed_at: float) -> str:
    """A job's `excluded` entry for the instance `key` that failed an attempt at `failed_at` (s since the
    epoch, Redis's clock, as `registered_at`): that incarnation, not the instance registered again after."""
    return f"{key}{INCARNATION}{failed_at:.6f}"


def _failed_at(raw: str) -> float:
    try:
        at = float(raw)
    except ValueError:
        at = float("nan")
    return at if at == at else float("inf")  # not a time (written by hand): every incarnation, as a plain key


def cached_run(prefix: tuple[str, ...], held: frozenset[str]) -> int:
    """How many of `prefix`'s leading blocks `held` has (chained digests: the matches are a prefix)."""
    if not held:
        return 0
    count = 0
    for digest in prefix:
        if digest not in held:
            break
        count += 1
    return count
