"""`Settings`: the control plane's one configuration (pydantic-settings, env prefix `PRFAAS_`), for every
process of it (API, Celery worker, beat), validated at start. Secrets that look like placeholders are refused
unless `dev` is set.

Flat fields read `PRFAAS_<FIELD>` (`PRFAAS_REDIS_URL`). Sections are small models read as
`PRFAAS_<SECTION>_<FIELD>` (the env name splits at its first `_` only, so `PRFAAS_DEFAULT_BUDGET_USD` is
`default.budget_usd`): `job` (`PRFAAS_JOB_TTL_S`, `PRFAAS_JOB_TIMEOUT_S`), `dispatch`
(`PRFAAS_DISPATCH_VISIBILITY_S`, `PRFAAS_DISPATCH_TIMEOUT_S`), `lease` (`PRFAAS_LEASE_FLOOR_S`,
`PRFAAS_LEASE_FACTOR`), `default` (`PRFAAS_DEFAULT_RPS`, `_CONCURRENCY`, `_BUDGET_USD`, `_MAX_TOKENS`,
`_TEMPERATURE`), `admission` (`PRFAAS_ADMISSION_HOLD_S`, `PRFAAS_ADMISSION_PLACEMENT`), `ledger`
(`PRFAAS_LEDGER_URL`), `prices` (`PRFAAS_PRICES_PATH`), `aws` (`PRFAAS_AWS_ENDPOINT_URL`,
`PRFAAS_AWS_TIMEOUT_S`), `pricing` (`PRFAAS_PRICING_ENDPOINT_URL`, `PRFAAS_PRICING_REGION`), `prefix`
(`PRFAAS_PREFIX_BLOCK_TOKENS`, `PRFAAS_PREFIX_SCOPE`) and `tls` (`PRFAAS_TLS_CA`, `PRFAAS_TLS_CERT`,
`PRFAAS_TLS_KEY`: the control plane's certificate, its key and the deployment's CA, each a path or the PEM
itself). In code: `Settings(ledger={"url": ...})` or `settings.ledger.url`. A flat field's first word is
never a section's name (`PRFAAS_JOB_X` would be read as `job.x`)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal, Self

from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from prfaas.region.channels import TlsFiles
from prfaas.transport.endpoints import is_loopback

PLACEHOLDERS = ("change-me", "changeme", "placeholder", "secret", "example")
MIN_SECRET_CHARS = 32
MIN_DISTINCT_CHARS = 8  # "xxxx...", "aaaa...": a filler, not a key (a random one has ~25 of 32 distinct)


def default_ledger_url() -> str:
    home = Path(os.environ.get("PRFAAS_HOME") or Path.home() / ".cache" / "prfaas").expanduser()
    return f"sqlite:///{home / 'ledger.db'}"


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True)


class LedgerSection(_Section):
    """`PRFAAS_LEDGER_URL`: the control plane's database: the usage ledger, the tenants and their keys (db/)."""

    url: str = Field(
        default_factory=default_ledger_url,
        description="SQLAlchemy URL of the ledger and tenants' database; default sqlite:///$PRFAAS_HOME/ledger.db",
    )


class PricesSection(_Section):
    """`PRFAAS_PRICES_PATH`: the price table (YAML, billing/prices.py); None: regions' registered prices."""

    path: Path | None = None


class AwsSection(_Section):
    """The live price feeds' EC2 calls (spot price history): `PRFAAS_AWS_ENDPOINT_URL` (moto's server in tests),
    `PRFAAS_AWS_TIMEOUT_S` (connect and read timeout of every AWS call, Price List included)."""

    endpoint_url: str | None = None
    timeout_s: float = Field(default=5.0, gt=0)


class PricingSection(_Section):
    """The AWS Price List API (boto3's `pricing` service): `PRFAAS_PRICING_ENDPOINT_URL` (a loopback server of
    recorded responses in tests), `PRFAAS_PRICING_REGION` (the API is served from us-east-1 and ap-south-1)."""

    endpoint_url: str | None = None
    region: str = "us-east-1"


class PrefixSection(_Section):
    """Hit-aware placement (engine/blocks.py): `PRFAAS_PREFIX_BLOCK_TOKENS`, the tokens per hashed prompt block
    (the regions' `prefix_block_tokens` must equal it), and `PRFAAS_PREFIX_SCOPE`: which requests share cached
    prompt blocks in a region: `tenant` (a tenant's own only: no tenant learns from its latency what others
    sent), `global` (every tenant's: a system prompt common to tenants is computed once), `off` (regions
    neither reuse nor keep prompt blocks)."""

    block_tokens: int = Field(default=64, ge=1, le=4096)
    scope: Literal["tenant", "global", "off"] = "tenant"


class JobSection(_Section):
    """A job's life in Redis: `PRFAAS_JOB_TIMEOUT_S`, the deadline of the whole job; `PRFAAS_JOB_TTL_S`, how
    long its keys outlive its end."""

    ttl_s: int = Field(default=7 * 86400, ge=1, description="finished jobs are kept this long in Redis")
    timeout_s: float = Field(default=300.0, gt=0, description="deadline of a whole job, as the API waits")


class DispatchSection(_Section):
    """Celery dispatch: `PRFAAS_DISPATCH_VISIBILITY_S` (the broker's visibility timeout) and
    `PRFAAS_DISPATCH_TIMEOUT_S` (the ceiling of a stage's lease)."""

    visibility_s: int = Field(
        default=60, ge=1, description="a dispatch task not acknowledged this long is handed to another worker"
    )
    timeout_s: float = Field(default=120.0, gt=0, description="longest lease of one attempt's prefill")
    no_region_wait_s: float = Field(
        default=30.0, gt=0, description="an attempt no region of the fleet can serve (none alive of a role it needs) "
        "waits this long for one to come back, then FAILED; one the fleet is too busy for waits until its deadline"
    )  # fmt: skip


class LeaseSection(_Section):
    """A stage's lease (jobs/dispatch.py): `PRFAAS_LEASE_FACTOR` x the scheduler's predicted TTFT, at least
    `PRFAAS_LEASE_FLOOR_S`, at most `dispatch.timeout_s`."""

    floor_s: float = Field(default=30.0, gt=0, description="shortest lease of a prefill (or reship) stage")
    factor: float = Field(default=4.0, ge=1, description="a stage's lease: this x the scheduler's prediction")


class DefaultSection(_Section):
    """What is not given: a new tenant's limits (`PRFAAS_DEFAULT_RPS`, `PRFAAS_DEFAULT_CONCURRENCY`,
    `PRFAAS_DEFAULT_BUDGET_USD`) and a request's `max_tokens` and `temperature` (`PRFAAS_DEFAULT_MAX_TOKENS`,
    `PRFAAS_DEFAULT_TEMPERATURE`)."""

    rps: float = Field(default=50.0, gt=0, description="tenant default: requests per second")
    concurrency: int = Field(default=16, ge=1, description="tenant default: concurrent jobs")
    budget_usd: float = Field(default=100.0, ge=0, description="tenant default: monthly $ budget")
    max_tokens: int = Field(
        default=16,
        ge=1,
        description="for completions without one (OpenAI's and vLLM's default; a chat without one "
        "gets what the context leaves, up to max_new_tokens_limit, as vLLM)",
    )
    temperature: float = Field(
        default=0.0, ge=0.0, le=2.0, description="for requests without one: 0 (greedy, reproducible); vLLM uses 1"
    )


class AdmissionSection(_Section):
    """Admission (jobs/store.py, api/completions.py): `PRFAAS_ADMISSION_HOLD_S`, `PRFAAS_ADMISSION_PLACEMENT`."""

    hold_s: float = Field(
        default=60.0,
        gt=0,
        description="a request admitted before its prompt is tokenized holds its concurrency slot this long at most",
    )
    placement: bool = Field(
        default=True, description="the API places local jobs itself at admission (no Celery round trip)"
    )


class Settings(BaseSettings):
    """One per control-plane deployable (API process, Celery worker, registry)."""

    model_config = SettingsConfigDict(
        env_prefix="PRFAAS_", extra="ignore", frozen=True, env_nested_delimiter="_", env_nested_max_split=1
    )

    dev: bool = Field(default=False, description="allow placeholder secrets (never in production)")
    redis_url: str = Field(default="redis://127.0.0.1:6379/0", description="job store, tenant cache, registry, broker")
    key_prefix: str = Field(default="prfaas", min_length=1, description="prefix of every Redis key")
    admin_key: SecretStr = Field(description="bearer key of the admin routes (and of the API's /metrics)")
    metrics_token: SecretStr | None = Field(
        default=None,
        description="a bearer token that reads the API's /metrics besides the admin key (a scraper's own, so "
        "Prometheus need not hold the admin key); None: the admin key only",
    )
    ticket_key: SecretStr = Field(description="HMAC key of KV transfer tickets (shared with decode regions)")
    ticket_key_id: str = "k1"
    model: str = Field(default="tiny-llama", description="the served model: catalog name or HF folder")
    model_fingerprint: str | None = Field(
        default=None,
        description="the model fingerprint every region must register with (`prfaas model list` shows it); None: "
        "the served model folder's, when it holds the weights (else regions are not checked)",
    )
    policy_path: Path | None = Field(default=None, description="scheduler policy YAML; None: the default policy")
    registry_listen: str | None = Field(
        default=None, description="host:port of the region registry gRPC service; None: not served by this process"
    )
    registry_insecure: bool = Field(
        default=False,
        description="serve the registry in plaintext off loopback (no tls): whoever reaches it can register a region "
        "and take over its endpoints; as a region's `insecure: true`",
    )
    heartbeat_misses: int = Field(default=3, ge=1, description="missed heartbeats before a region is dead")
    measure_links: bool = Field(
        default=True, description="move the configured links by what the KV senders measure; false: configured only"
    )
    max_attempts: int = Field(default=3, ge=1, description="dispatch attempts before a job is FAILED")
    backoff_s: float = Field(default=0.2, ge=0, description="first retry backoff; doubles each attempt, +-50% jitter")
    beat_s: float = Field(default=1.0, gt=0, description="workers and API processes beat this often")
    dead_after_s: float = Field(default=3.0, gt=0, description="a worker or API process silent this long is dead")
    sweep_s: float = Field(default=1.0, gt=0, description="the sweeper looks for overrun leases this often")
    tenant_cache_ttl_s: float = Field(
        default=60.0, gt=0, description="tenants and keys cached in Redis are read from the database again after this"
    )
    max_new_tokens_limit: int = Field(default=4096, ge=1)
    max_waiting_requests: int = Field(
        default=512,
        ge=1,
        description="requests of one API process that wait on their jobs' tokens at once, a thread each (more "
        "queue for a thread); the routes and health probes have threads of their own (api/threads.py)",
    )
    max_body_bytes: int = Field(
        default=8 * 2**20,
        ge=1024,
        description="largest request body (413 beyond, counted while reading, chunked bodies too); 8 MiB holds a "
        "128k-token prompt as token ids (~1 MB of JSON) several times over",
    )
    sse_keepalive_s: float = Field(
        default=15.0,
        ge=0,
        description="a stream with nothing to send this long gets an SSE comment (': keep-alive'), so a proxy's "
        "idle timeout does not cut a job waiting for a busy fleet; 0: never",
    )
    shutdown_timeout_s: float = Field(
        default=20.0,
        ge=0,
        le=3600,
        description="on SIGTERM (or SIGINT) the API drains, as vLLM's --shutdown-timeout: readiness and new "
        "generation requests get 503 server_shutting_down, requests in flight go on this long, then their jobs "
        "are canceled and each client gets that 503 as its stream's last event (api/shutdown.py); 0: at once",
    )
    snapshot_ttl_s: float = Field(default=0.25, ge=0, description="how stale the API's view of the fleet may be")
    ttft_slo_ms: float = Field(default=600_000.0, gt=0, description="SLO given to the scheduler")
    tpot_slo_ms: float = Field(default=60_000.0, gt=0)
    job: JobSection = Field(default_factory=JobSection)
    dispatch: DispatchSection = Field(default_factory=DispatchSection)
    lease: LeaseSection = Field(default_factory=LeaseSection)
    default: DefaultSection = Field(default_factory=DefaultSection)
    admission: AdmissionSection = Field(default_factory=AdmissionSection)
    ledger: LedgerSection = Field(default_factory=LedgerSection)
    prices: PricesSection = Field(default_factory=PricesSection)
    aws: AwsSection = Field(default_factory=AwsSection)
    pricing: PricingSection = Field(default_factory=PricingSection)
    prefix: PrefixSection = Field(default_factory=PrefixSection)
    tls: TlsFiles | None = Field(
        default=None,
        description="mutual TLS to the regions and on the registry: PRFAAS_TLS_CA, PRFAAS_TLS_CERT, PRFAAS_TLS_KEY "
        "(paths or PEM); the certificate names prfaas://control-plane/NAME. None: plaintext (one host)",
    )

    @model_validator(mode="after")
    def _control_plane_certificate(self) -> Self:
        if self.tls is not None and not self.tls.identity.is_control_plane:
            raise ValueError(f"tls.cert names {self.tls.identity.uri}, not a prfaas://control-plane/NAME identity")
        return self

    @model_validator(mode="after")
    def _registry_tls(self) -> Self:
        plaintext = self.tls is None and not self.registry_insecure
        if self.registry_listen and plaintext and not is_loopback(self.registry_listen):
            raise ValueError(
                f"registry_listen {self.registry_listen} is not on loopback and there is no tls: set tls "
                "(certificates from `prfaas certs init`), or registry_insecure=true to serve it in plaintext"
            )
        return self

    @model_validator(mode="after")
    def _real_secrets(self) -> Self:
        if self.dev:
            return self
        for name in ("admin_key", "ticket_key", "metrics_token"):
            if (secret := getattr(self, name)) is None:  # metrics_token: the admin key only
                continue
            value = secret.get_secret_value()
            # not "xxx" as a word: it is in about 1 of 800 random url-safe keys (`prfaas up`'s own)
            if (len(value) < MIN_SECRET_CHARS or any(p in value.lower() for p in PLACEHOLDERS)
                    or len(set(value)) < MIN_DISTINCT_CHARS):  # fmt: skip
                raise ValueError(
                    f"{name} looks like a placeholder (< {MIN_SECRET_CHARS} chars, a stock word or a filler); "
                    "dev=true allows it"
                )
        return self

    def key(self, *parts: str) -> str:
        return ":".join((self.key_prefix, *parts))
