"""`ClusterSnapshot`: the frozen picture of the fleet the scheduler decides on.

Built by the control plane from region heartbeats and link probes (or by the simulator from its
models), then handed to `GlobalScheduler.decide` as is. Every figure is a measurement or a
price; the scheduler never reaches out for more. JSON documents of this shape are what
`prfaas sched explain --snapshot` reads (docs/scheduler.md, "Snapshot schema").
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from typing import Annotated, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

NonNegFloat = Annotated[float, Field(ge=0, allow_inf_nan=False)]
PosFloat = Annotated[float, Field(gt=0, allow_inf_nan=False)]
MAX_RTT_MS = 60_000.0  # a link's round trip, at most: a figure above is a typo or a broken meter
MAX_BANDWIDTH_GBPS = 100_000.0  # 100 Tbit/s


class Role(StrEnum):
    """What a region's workers do. Every region can prefill (a decode region prefills short or
    cache-warm prompts itself); only `decode` and `both` regions decode."""

    PREFILL = "prefill"
    DECODE = "decode"
    BOTH = "both"


KVDtype = Literal["float32", "bfloat16", "float16"]
KV_DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2}


def kv_dtypes_alike(a: str | None, b: str | None) -> bool:
    """Whether KV in dtype `a` may go to a region holding `b` (a decode region refuses another dtype's);
    None or "" (not reported) is alike to any."""
    return not a or not b or a == b


class Region(BaseModel):
    """One region's capacity, prices and load, as of its last heartbeat."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(min_length=1)
    role: Role
    gpu_type: str = Field(min_length=1)
    num_gpus: int = Field(ge=1)
    num_workers: int = Field(ge=1, description="model replicas; each holds num_gpus / num_workers GPUs")
    usd_per_gpu_hour: NonNegFloat = Field(description="on-demand price, $ per GPU-hour")
    spot_usd_per_gpu_hour: NonNegFloat | None = Field(default=None, description="spot price, if the region has one")
    queue_depth: int = Field(default=0, ge=0, description="prefill jobs waiting for a worker")
    queue_capacity: int | None = Field(default=None, ge=1, description="admission limit of the queue; None: unbounded")
    num_busy_workers: int = Field(default=0, ge=0)
    mean_prefill_s: NonNegFloat = Field(default=0.0, description="mean duration of recent prefill jobs, s")
    queued_prefill_tokens: int | None = Field(
        default=None,
        ge=0,
        description="prompt tokens admitted and not started; None: not reported (the queue "
        "wait is then queue_depth x mean_prefill_s)",
    )
    running_prefill_tokens: int = Field(default=0, ge=0, description="prompt tokens being computed now")
    decode_running: int = Field(default=0, ge=0, description="sequences decoding now")
    decode_slots: int = Field(default=0, ge=0, description="sequences it decodes at once at most; 0: not reported")
    kv_buffer_free_bytes: int = Field(ge=0, description="KV buffer a decode reservation can still take, bytes")
    kv_buffer_bytes: int | None = Field(
        default=None, ge=0, description="the whole KV buffer (free + reserved), bytes; None: not reported"
    )
    kv_buffer_largest_free_bytes: int | None = Field(
        default=None,
        ge=0,
        description="the most KV one reservation can take, bytes: the largest free buffer of one of its instances "
        "(a reservation lands on one, however much the others have free); None: kv_buffer_free_bytes",
    )
    prefill_tokens_per_s: PosFloat = Field(description="measured prefill throughput of one worker, tokens/s")
    decode_tokens_per_s: PosFloat = Field(description="measured decode throughput of one worker, all sequences, tok/s")
    tpot_ms: PosFloat = Field(description="measured time per output token of one sequence at current load, ms")
    decode_nominal_tokens_per_s: PosFloat | None = Field(
        default=None,
        description="one worker's decode tokens/s at its full batch: what prices decode when known, so a "
        "region's price per token does not fall as its batch fills (None: decode_tokens_per_s prices it)",
    )
    healthy: bool = True
    excluded: bool = Field(
        default=False, description="left out of this request's placement: its instances failed an earlier attempt "
        "(a retry's snapshot; the scheduler cuts it before the policy's filters)",
    )  # fmt: skip
    heartbeat_age_s: NonNegFloat = Field(default=0.0, description="seconds since the last heartbeat")
    heartbeat_interval_s: PosFloat | None = Field(
        default=None, description="seconds between its heartbeats (its instances' longest); None: not reported"
    )
    cached_prefix_hashes: frozenset[str] = Field(
        default=frozenset(), description="chained hashes of the prompt blocks in this region's prefix cache"
    )
    kv_dtype: KVDtype | None = Field(
        default=None, description="its engine's KV dtype; a split needs both ends alike (None: not reported)"
    )

    @model_validator(mode="after")
    def _busy_within_workers(self) -> Self:
        if self.num_busy_workers > self.num_workers:
            raise ValueError(f"num_busy_workers ({self.num_busy_workers}) exceeds num_workers ({self.num_workers})")
        return self

    @property
    def can_decode(self) -> bool:
        return self.role is not Role.PREFILL

    @property
    def can_serve_split_prefill(self) -> bool:
        return self.role is not Role.DECODE

    def ships_kv_to(self, decode: Region) -> bool:
        """Whether a decode region takes this region's KV: the same dtype, when both report one (a decode
        region refuses KV of another dtype)."""
        return kv_dtypes_alike(self.kv_dtype, decode.kv_dtype)

    @property
    def gpus_per_worker(self) -> float:
        return self.num_gpus / self.num_workers

    @property
    def kv_reservable_bytes(self) -> int:
        """The most KV buffer one decode reservation can take here, bytes."""
        largest = self.kv_buffer_largest_free_bytes
        return self.kv_buffer_free_bytes if largest is None else min(largest, self.kv_buffer_free_bytes)

    @property
    def queue_full(self) -> bool:
        return self.queue_capacity is not None and self.queue_depth >= self.queue_capacity


class Link(BaseModel):
    """A measured, directed path from a prefill region (`src`) to a decode region (`dst`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    src: str = Field(min_length=1)
    dst: str = Field(min_length=1)
    rtt_ms: NonNegFloat = Field(le=MAX_RTT_MS)
    bandwidth_gbps: NonNegFloat = Field(
        le=MAX_BANDWIDTH_GBPS, description="measured goodput the transport reaches on this path, Gbit/s"
    )
    utilization: float = Field(default=0.0, ge=0, le=1, description="share of bandwidth_gbps in use by other transfers")
    egress_usd_per_gb: NonNegFloat = Field(default=0.0, description="$ per GB (10^9 bytes) leaving src toward dst")

    @model_validator(mode="after")
    def _not_a_loop(self) -> Self:
        if self.src == self.dst:
            raise ValueError(f"link from {self.src!r} to itself")
        return self

    @property
    def free_bytes_per_s(self) -> float:
        """Bandwidth left for a new shipment, bytes/s."""
        return self.bandwidth_gbps * 1e9 / 8 * (1.0 - self.utilization)


class ModelShape(BaseModel):
    """The served model's KV geometry (one model per snapshot)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(min_length=1)
    num_layers: int = Field(ge=1)
    kv_bytes_per_token: int = Field(ge=1, description="K and V of one token over all layers, bytes, as decoded")
    kv_dtype: KVDtype | None = Field(
        default=None, description="the dtype kv_bytes_per_token is counted in; None: every region's alike"
    )
    kv_state_bytes: int = Field(
        default=0,
        ge=0,
        description="per request, whatever its length: a hybrid model's recurrent (linear-attention) states, "
        "bytes; reserved with the KV in the decode region and shipped with it on a split (0: a dense model)",
    )

    def kv_bytes_at(self, dtype: str | None) -> int:
        """K and V of one token in `dtype` (a region's engine's; None or "": not reported, the model's figure)."""
        if not dtype or self.kv_dtype is None or dtype == self.kv_dtype:
            return self.kv_bytes_per_token
        return self.kv_bytes_per_token * KV_DTYPE_BYTES[dtype] // KV_DTYPE_BYTES[self.kv_dtype]


class ClusterSnapshot(BaseModel):
    """Regions, links and the model, frozen at `taken_at_s`. Indexes are built once, here."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    taken_at_s: NonNegFloat = Field(default=0.0, description="when the snapshot was assembled, s since the epoch")
    model: ModelShape
    regions: tuple[Region, ...]
    links: tuple[Link, ...] = ()

    _by_name: dict[str, Region] = PrivateAttr(default_factory=dict)
    _links_into: dict[str, tuple[Link, ...]] = PrivateAttr(default_factory=dict)

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        by_name: dict[str, Region] = {}
        for region in self.regions:
            if region.name in by_name:
                raise ValueError(f"duplicate region name {region.name!r}")
            by_name[region.name] = region
        into: dict[str, list[Link]] = {}
        seen: set[tuple[str, str]] = set()
        for link in self.links:
            for end in (link.src, link.dst):
                if end not in by_name:
                    raise ValueError(f"link {link.src}->{link.dst} names unknown region {end!r}")
            if (link.src, link.dst) in seen:
                raise ValueError(f"duplicate link {link.src}->{link.dst}")
            seen.add((link.src, link.dst))
            into.setdefault(link.dst, []).append(link)
        self._by_name = by_name
        self._links_into = {dst: tuple(links) for dst, links in into.items()}
        return self

    def region(self, name: str) -> Region:
        return self._by_name[name]

    def regions_by_name(self) -> Mapping[str, Region]:
        """Name -> region (read-only use; one lookup of the index for many regions)."""
        return self._by_name

    def links_into(self, dst: str) -> tuple[Link, ...]:
        """Every link whose destination is `dst`, in snapshot order."""
        return self._links_into.get(dst, ())
