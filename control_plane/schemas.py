"""Request and response schemas of the HTTP API (OpenAI-compatible and management)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

Placement = Literal["auto", "local", "split"]


class PrfaasOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    placement: Placement = "auto"


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Generation(BaseModel):
    model_config = ConfigDict(extra="ignore")  # OpenAI fields we do not act on (n=1, top_p, user, ...)

    model: str = Field(min_length=1, max_length=256)
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: float = Field(default=0.0, ge=0.0, le=2.0, allow_inf_nan=False)
    seed: Annotated[int, Field(ge=0, le=2**63 - 1)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    prfaas: PrfaasOptions | None = None


class CompletionCreate(_Generation):
    prompt: (
        Annotated[str, Field(min_length=1, max_length=4_000_000)]
        | Annotated[list[Annotated[int, Field(ge=0, lt=2**32)]], Field(min_length=1, max_length=1_000_000)]
    )


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant"]
    content: str = Field(max_length=4_000_000)


class ChatCompletionCreate(_Generation):
    messages: list[ChatMessage] = Field(min_length=1, max_length=1000)
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None


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
    bytes_raw: int
    bytes_wire: int
    cost_usd: float
    colocated_cost_usd: float
    usage: Usage
    finish_reason: str | None
    error: str | None
    timeline: list[TimelineEntry]
    decision: dict[str, Any] | None


class JobList(BaseModel):
    object: Literal["list"] = "list"
    data: list[JobPublic]


class TenantCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=128)
    rps: float | None = Field(default=None, gt=0, le=1e6)
    concurrency: int | None = Field(default=None, ge=1, le=1_000_000)
    budget_usd: float | None = Field(default=None, ge=0, le=1e12)
    allow_placement: bool = False


class TenantUpdate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    status: Literal["active", "suspended"] | None = None
    rps: float | None = Field(default=None, gt=0, le=1e6)
    concurrency: int | None = Field(default=None, ge=1, le=1_000_000)
    budget_usd: float | None = Field(default=None, ge=0, le=1e12)
    allow_placement: bool | None = None


class TenantPublic(BaseModel):
    id: str
    name: str
    status: str
    rps: float
    concurrency: int
    budget_usd: float
    allow_placement: bool
    spend_usd_this_month: float
    active_jobs: int


class ApiKeyPublic(BaseModel):
    id: str
    tenant: str
    revoked: bool
    created_at: float


class ApiKeyIssued(ApiKeyPublic):
    key: str = Field(description="the full key: shown once, only its hash is stored")


class RegionPublic(BaseModel):
    name: str
    role: str
    gpu_type: str
    num_workers: int
    usd_per_gpu_hour: float
    grpc_endpoint: str
    kv_endpoint: str
    alive: bool
    healthy: bool
    draining: bool
    drained: bool
    heartbeat_age_s: float
    queue_depth: int
    busy_workers: int
    kv_used_bytes: int
    kv_free_bytes: int


class LinkPublic(BaseModel):
    model_config = ConfigDict(extra="forbid")
    src: str = Field(min_length=1, max_length=63)
    dst: str = Field(min_length=1, max_length=63)
    rtt_ms: float = Field(ge=0, le=1e6, allow_inf_nan=False)
    bandwidth_gbps: float = Field(ge=0, le=1e6, allow_inf_nan=False)
    egress_usd_per_gb: float = Field(default=0.0, ge=0, le=1e6, allow_inf_nan=False)
