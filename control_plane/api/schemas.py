"""Request and response schemas of the HTTP API, a family per resource: jobs, tenants and keys, regions and
links, usage (generation: api/openai_schemas.py). Internal records (the Redis job hash, a region record, a
ledger row) never leave as they are: routes map them onto these."""

from __future__ import annotations

import datetime as dt
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from prfaas.control_plane.billing.queries import GroupTotal
from prfaas.control_plane.scheduling.snapshot import MAX_BANDWIDTH_GBPS, MAX_RTT_MS
from prfaas.transport.identity import REGION_NAME

REGION_PATTERN = f"^{REGION_NAME.pattern}$"


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class TimelineEntry(BaseModel):
    state: str
    attempt: int
    at: float
    note: str = ""


class JobPublic(BaseModel):
    id: str
    object: Literal["prfaas.job"] = "prfaas.job"
    state: str
    attempt: int
    model: str
    created_at: float
    updated_at: float
    placement_asked: str
    placement_chosen: str | None
    prefill_region: str | None
    decode_region: str | None
    prefill_instance: str | None = Field(default=None, description="the prefill region's instance that ran it")
    decode_instance: str | None = Field(default=None, description="the decode region's instance that ran it")
    bytes_raw: int
    bytes_wire: int
    cost_usd: float
    colocated_cost_usd: float
    usage: Usage
    finish_reason: str | None
    error: str | None
    timeline: list[TimelineEntry]
    decision: dict[str, Any] | None
    user: str | None = Field(default=None, description="the request's `user`")
    stop_reason: str | None = Field(default=None, description="finish 'stop': the stop string or stop token id")
    sampling: dict[str, Any] | None = Field(default=None, description="the sampling specification it ran with")
    ttft_slo_ms: float | None = Field(default=None, description="the TTFT objective it was placed against")
    tpot_slo_ms: float | None = Field(default=None, description="the TPOT objective it was placed against")
    kv_codec: str = Field(default="lossless", description="the KV codec it consented to (the one used: decision.codec)")
    cached_tokens: int = Field(
        default=0,
        description="leading prompt tokens a region's prefix cache served: prompt_tokens - cached_tokens "
        "were computed by the attempt that produced the answer",
    )


class JobList(BaseModel):
    object: Literal["list"] = "list"
    data: list[JobPublic]


class TenantCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=128, pattern=r"^[^\x00-\x1f\x7f]+$")  # no control characters
    rps: float | None = Field(default=None, gt=0, le=1e6)
    concurrency: int | None = Field(default=None, ge=1, le=1_000_000)
    budget_usd: float | None = Field(default=None, ge=0, le=1e12)
    allow_placement: bool = False
    ttft_slo_ms: float | None = Field(default=None, gt=0, le=3_600_000, description="its requests' default")
    tpot_slo_ms: float | None = Field(default=None, gt=0, le=600_000, description="its requests' default")
    kv_codec: str | None = Field(default=None, min_length=1, max_length=32, description="its requests' default")


class TenantUpdate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    status: Literal["active", "suspended"] | None = None
    rps: float | None = Field(default=None, gt=0, le=1e6)
    concurrency: int | None = Field(default=None, ge=1, le=1_000_000)
    budget_usd: float | None = Field(default=None, ge=0, le=1e12)
    allow_placement: bool | None = None
    ttft_slo_ms: float | None = Field(default=None, gt=0, le=3_600_000)
    tpot_slo_ms: float | None = Field(default=None, gt=0, le=600_000)
    kv_codec: str | None = Field(default=None, min_length=1, max_length=32)


class TenantPublic(BaseModel):
    id: str
    name: str
    status: str
    rps: float
    concurrency: int
    budget_usd: float
    allow_placement: bool
    ttft_slo_ms: float | None = Field(description="its requests' default TTFT objective; null: the control plane's")
    tpot_slo_ms: float | None = Field(description="its requests' default TPOT objective; null: the control plane's")
    kv_codec: str | None = Field(description="its requests' default KV codec consent; null: lossless")
    spend_usd_this_month: float
    reserved_usd: float = Field(
        description="$ of the budget held by jobs in flight (their predicted cost) until billed"
    )
    active_jobs: int


class ApiKeyPublic(BaseModel):
    id: str
    tenant: str
    revoked: bool
    created_at: float


class ApiKeyIssued(ApiKeyPublic):
    key: str = Field(description="the full key: shown once, only its hash is stored")


class LoadPublic(BaseModel):
    """Health and load as of the last heartbeat (a region's: summed over its healthy instances)."""

    alive: bool = Field(description="a heartbeat within heartbeat_misses intervals (a region: of an instance)")
    healthy: bool = Field(description="alive, not draining, not drained: the scheduler may place new work there")
    draining: bool = Field(description="stopping (SIGTERM; a region: every live instance)")
    heartbeat_age_s: float = Field(description="seconds since the last beat (a region: its most recent)")
    num_workers: int = Field(description="model replicas serving")
    queue_depth: int = Field(description="prefill jobs waiting for a worker")
    busy_workers: int
    kv_used_bytes: int = Field(description="KV buffer reserved")
    kv_free_bytes: int


class InstancePublic(LoadPublic):
    """One instance of a region."""

    instance: str = Field(description="its id within the region")
    grpc_endpoint: str = Field(description="host:port of its gRPC service (its advertised address)")
    kv_endpoint: str = Field(description="where KV caches are shipped to it (decode roles)")


class RegionPublic(LoadPublic):
    """A region as the admin API shows it: a pool of instances."""

    name: str
    role: str = Field(description="prefill, decode or both")
    gpu_type: str
    usd_per_gpu_hour: float = Field(description="the $/GPU-hour it registered (prices: GET /admin/prices)")
    drained: bool = Field(description="an operator drained it (POST /admin/regions/{name}/drain)")
    instances: list[InstancePublic]


class LinkPublic(BaseModel):
    model_config = ConfigDict(extra="forbid")
    src: str = Field(pattern=REGION_PATTERN)  # a region's name, as a region config's `name`
    dst: str = Field(pattern=REGION_PATTERN)  # (a "/" in one made a link DELETE could not name)
    # the scheduler's own limits (snapshot.Link), so a figure over them is refused naming its field
    rtt_ms: float = Field(ge=0, le=MAX_RTT_MS, allow_inf_nan=False)
    bandwidth_gbps: float = Field(ge=0, le=MAX_BANDWIDTH_GBPS, allow_inf_nan=False)
    egress_usd_per_gb: float = Field(default=0.0, ge=0, le=1e6, allow_inf_nan=False)


class LinkMeasured(BaseModel):
    """What the prefill region's KV senders measured on the link (control_plane/fleet/links.py)."""

    bandwidth_gbps: float | None  # smoothed goodput while the path was the limit; None: not seen yet
    min_rtt_ms: float | None
    srtt_ms: float | None
    sending_gbps: float  # smoothed rate the path carries
    backlogged_bytes: int  # measured goodput's weight: bytes sent while backlogged
    weight: float  # how far the measured bandwidth replaces the configured one (0..1)
    retransmits: int
    age_s: float


class LinkScheduled(BaseModel):
    """The link as the scheduler sees it now (configured, moved by fresh measurements)."""

    rtt_ms: float
    bandwidth_gbps: float
    utilization: float


class LinkView(LinkPublic):
    """GET /admin/links: the configured figures (the fields PUT takes) beside the measured ones."""

    measured: LinkMeasured | None = None
    scheduled: LinkScheduled


# -- usage -------------------------------------------------------------------------------------


class UsageRow(GroupTotal):
    """One row of a usage report: the ledger's `GroupTotal`, field for field (derived, so the two cannot drift)."""


class UsageReport(BaseModel):
    object: Literal["usage"] = "usage"
    tenant: str | None
    start: dt.datetime
    end: dt.datetime
    group_by: str
    data: list[UsageRow]


class UsageEntryPublic(BaseModel):
    """One job's bill (the ledger entry without its row id): the work, the prices given, the $ they make:
    prefill_usd = prefill_gpu_s / 3600 x prefill_usd_per_gpu_h, decode_usd likewise, egress_usd =
    kv_bytes_wire / 1e9 x egress_usd_per_gb."""

    job_id: str
    tenant: str
    model: str
    placement: str
    attempts: int
    prefill_region: str
    decode_region: str
    finished_at: dt.datetime
    prefill_gpu_s: float
    decode_gpu_s: float
    colocated_prefill_gpu_s: float
    prefill_usd_per_gpu_h: float
    decode_usd_per_gpu_h: float
    egress_usd_per_gb: float
    tokens_in: int
    tokens_out: int
    kv_bytes_raw: int
    kv_bytes_wire: int
    prefill_usd: float
    decode_usd: float
    egress_usd: float
    total_usd: float = Field(description="prefill_usd + decode_usd + egress_usd: what the tenant is billed")
    colocated_usd: float = Field(description="(colocated_prefill_gpu_s + decode_gpu_s) / 3600 x decode_usd_per_gpu_h")
    savings_usd: float = Field(description="colocated_usd - total_usd")
    ttft_s: float | None
    tpot_s: float | None
    codec: str = Field(default="", description="the KV codec its shipment crossed in (empty: local)")


class WastedPublic(BaseModel):
    attempt: int
    phase: str
    region: str
    gpu_s: float
    usd_per_gpu_h: float
    cost_usd: float
    reason: str


class AdminJobUsage(BaseModel):
    entry: UsageEntryPublic | None
    wasted: list[WastedPublic]
