"""Request and response schemas of the HTTP API, a family per resource: generation (OpenAI-compatible),
jobs, tenants and keys, regions and links, usage. Internal records (the Redis job hash, a region record, a
ledger row) never leave as they are: routes map them onto these."""

from __future__ import annotations

import datetime as dt
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from prfaas.control_plane.billing.queries import GroupTotal

# auto: the scheduler decides; local / split: forced (tenants allowed to); auto-prefix-blind and
# auto-residency-blind: the scheduler decides without prefix caches, or without knowing where they hold what
# (benchmark baselines: control_plane/jobs/prefix.py)
Placement = Literal["auto", "local", "split", "auto-prefix-blind", "auto-residency-blind"]


class PrfaasOptions(BaseModel):
    """The request's `prfaas` extension: where it may run and what it asks of the placement (each left
    unset takes the tenant's default, then the control plane's; control_plane/jobs/objectives.py)."""

    model_config = ConfigDict(extra="forbid")
    placement: Placement = "auto"
    ttft_slo_ms: float | None = Field(default=None, gt=0, le=3_600_000, allow_inf_nan=False,
                                      description="time to first token objective, ms")  # fmt: skip
    tpot_slo_ms: float | None = Field(default=None, gt=0, le=600_000, allow_inf_nan=False,
                                      description="time per output token objective, ms")  # fmt: skip
    kv_codec: str | None = Field(
        default=None, min_length=1, max_length=32,
        description="lossless (the KV crosses the WAN bit for bit), or a lossy codec of the policy it may use",
    )  # fmt: skip


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage on every chunk


TokenId = Annotated[int, Field(ge=0, lt=2**32)]
Stop = Annotated[str, Field(min_length=1, max_length=256)]
MetadataKey = Annotated[str, Field(max_length=64)]  # OpenAI's limits: 16 pairs, keys of 64, values of 512 characters
MetadataValue = Annotated[str, Field(max_length=512)]
# Parameters of OpenAI's schemas that prfaas does not implement: refused with 400 `unsupported_parameter`
# (api/errors.py) unless null. The lists are walked by tests/control_plane/api/test_openai_params.py.
REFUSED_COMPLETION = ("best_of", "suffix")
REFUSED_CHAT = (
    "audio", "function_call", "functions", "modalities", "moderation", "prediction", "prompt_cache_options",
    "prompt_cache_retention", "reasoning_effort", "response_format", "tool_choice", "tools", "verbosity",
    "web_search_options",
)  # fmt: skip


class _Generation(BaseModel):
    """The sampling fields both endpoints share: OpenAI's, and vLLM's extras (`top_k`, `min_p`,
    `repetition_penalty`, `min_tokens`, `stop_token_ids`, `ignore_eos`). Unknown fields are refused
    (400 naming them), never ignored; docs/control-plane.md has the table."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, max_length=256)
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int | None = Field(default=None, ge=-1, le=1_000_000)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0, allow_inf_nan=False)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0, allow_inf_nan=False)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=2.0, allow_inf_nan=False)
    min_tokens: int | None = Field(default=None, ge=0)
    stop: Stop | Annotated[list[Stop], Field(max_length=16)] | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=16)] | None = None
    ignore_eos: bool | None = None
    seed: Annotated[int, Field(ge=0, le=2**63 - 1)] | None = None
    logit_bias: Annotated[dict[str, Annotated[float, Field(ge=-100, le=100)]], Field(max_length=300)] | None = None
    n: int | None = Field(default=None, ge=1, le=16, description="choices per prompt: one prefill, n decodes")
    user: str | None = Field(default=None, max_length=256)
    cache_salt: str | None = Field(
        default=None, min_length=1, max_length=256,
        description="vLLM's: prefix cache blocks are shared only among requests with the same salt (within the "
        "tenant's scope, PRFAAS_PREFIX_SCOPE)",
    )  # fmt: skip
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    prfaas: PrfaasOptions | None = None


class CompletionCreate(_Generation):
    prompt: (
        Annotated[str, Field(min_length=1, max_length=4_000_000)]
        | Annotated[list[Annotated[str, Field(min_length=1, max_length=4_000_000)]], Field(min_length=1, max_length=64)]
        | Annotated[list[TokenId], Field(min_length=1, max_length=1_000_000)]
        | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1, max_length=64)]
    )
    max_tokens: Annotated[int, Field(ge=0)] | None = None  # 0: with `echo` only (the prompt scored, vLLM's)
    echo: bool | None = False
    logprobs: int | None = Field(default=None, ge=0, le=20)
    best_of: None = None
    suffix: None = None

    @property
    def echo_only(self) -> bool:
        """`echo` with `max_tokens` 0: the prompt alone comes back (with its logprobs when asked), as vLLM
        answers it: one token is generated (in `usage` and `finish_reason`), not shown."""
        return bool(self.echo) and self.max_tokens == 0


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str = Field(max_length=4_000_000)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant"]
    content: Annotated[str, Field(max_length=4_000_000)] | Annotated[list[ContentPart], Field(max_length=100)]
    name: str | None = Field(default=None, max_length=256)

    def text(self) -> str:
        """The content as the chat template reads it (text parts joined by newlines, as vLLM does)."""
        return self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content)


class ChatCompletionCreate(_Generation):
    messages: list[ChatMessage] = Field(min_length=1, max_length=1000)
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    # accepted with no effect, as OpenAI documents them: identifiers and hints for OpenAI's own services
    safety_identifier: str | None = Field(default=None, max_length=256)
    prompt_cache_key: str | None = Field(default=None, max_length=1024)
    metadata: dict[MetadataKey, MetadataValue] | None = Field(default=None, max_length=16)
    store: Literal[False] | None = None
    service_tier: Literal["auto", "default"] | None = None
    parallel_tool_calls: bool | None = None
    audio: None = None
    function_call: None = None
    functions: None = None
    modalities: None = None
    moderation: None = None
    prediction: None = None
    prompt_cache_options: None = None
    prompt_cache_retention: None = None
    reasoning_effort: None = None
    response_format: None = None
    tool_choice: None = None
    tools: None = None
    verbosity: None = None
    web_search_options: None = None


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
    src: str = Field(min_length=1, max_length=63)
    dst: str = Field(min_length=1, max_length=63)
    rtt_ms: float = Field(ge=0, le=1e6, allow_inf_nan=False)
    bandwidth_gbps: float = Field(ge=0, le=1e6, allow_inf_nan=False)
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
