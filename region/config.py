"""A region's configuration: one YAML file per region process (`prfaas region --config FILE`).

Shared by both agents (regions never import each other) and by the CLI that starts them.
Validated at load; every error names the field (`listen.kv: ...`). Any field can also be
set from the environment, `PRFAAS_` + the field path joined by `__` (e.g.
`PRFAAS_TICKET_KEY`, `PRFAAS_LISTEN__GRPC`); the YAML file wins over the environment.
"""

from __future__ import annotations

import ipaddress
import math
import os
import re
import socket
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from prfaas.region.channels import TlsFiles
from prfaas.transport.endpoints import is_loopback, parse_hostport
from prfaas.transport.identity import Identity
from prfaas.transport.webrtc import IceServer

PLACEHOLDER_KEYS = {"changeme", "change-me", "secret", "dev", "placeholder"}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS |= {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
_DNS_LABEL = re.compile(r"^(?!-)[A-Za-z0-9-]{1,63}(?<!-)$")


class ConfigError(ValueError):
    """A region config that cannot be used; the message names the file and the field."""


def parse_bytes(value: object) -> int:
    """`1073741824`, `"1GiB"`, `"512 MB"` -> bytes."""
    if isinstance(value, bool):
        raise ValueError("expected a byte count like 1073741824 or '1GiB'")
    if isinstance(value, int):
        return value
    match = _SIZE.match(str(value))
    size = float(match.group(1)) * _UNITS[(match.group(2) or "B").lower()] if match else math.nan
    if not math.isfinite(size):  # 400 digits read as inf
        raise ValueError(f"{value!r} is not a byte count like 1073741824 or '1GiB'")
    return int(size)


def dialable_host(value: str) -> str:
    """`advertise`: an IP address (IPv6 bare or in brackets; returned bare, `hostport` adds them) or a DNS name,
    not a wildcard. ValueError otherwise: a port, a scheme or a space here made an endpoint nobody can dial."""
    bare = value[1:-1] if value.startswith("[") and value.endswith("]") else value
    try:
        address = ipaddress.ip_address(bare)
    except ValueError:
        labels = value.removesuffix(".").split(".")
        if len(value) > 253 or not all(_DNS_LABEL.match(label) for label in labels) or labels[-1].isdigit():
            raise ValueError(
                f"{value!r} is not an IP address or a DNS name (a host only: no scheme, no port, no spaces)"
            ) from None
        return value
    if address.is_unspecified:
        raise ValueError(f"{value!r} is a wildcard address, not one others can dial")
    return bare


def _host_instance() -> str:
    """This host's name as an instance id (a region's instances run on hosts of their own)."""
    name = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname()).strip("-._")
    return name[:128] or "instance"


class Listen(BaseModel):
    model_config = ConfigDict(extra="forbid")

    grpc: str = "127.0.0.1:50051"  # host:port of the gRPC services
    kv: str = "127.0.0.1:7400"  # host:port of the KV port (decode role)
    metrics: str | None = None  # host:port of Prometheus /metrics; None = off

    @field_validator("grpc", "kv", "metrics")
    @classmethod
    def _hostport(cls, value: str | None) -> str | None:
        if value is not None:
            parse_hostport(value)
        return value


class IceServerConfig(BaseModel):
    """A STUN or TURN server for `transport: webrtc` (none by default: host candidates only)."""

    model_config = ConfigDict(extra="forbid")

    urls: list[str] = Field(min_length=1)  # e.g. ["stun:stun.example:3478"], ["turn:turn.example:3478"]
    username: str | None = None
    credential: str | None = Field(default=None, repr=False)


class VLLMOptions(BaseModel):
    """`engine: vllm`: the region starts a vLLM server (engine/vllm/server.py) with the vLLM
    environment's python and drives it over a loopback control socket (docs/vllm.md)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    python: str | None = None  # the vLLM environment's interpreter; None: <repo>/.venv-vllm/bin/python
    start_timeout_s: float = Field(default=600.0, gt=0, le=3600)  # vLLM start-up: 45-160 s on 2 CPU cores
    enforce_eager: bool = True  # skip torch.compile: faster start-up, slower steps
    max_model_len: int = Field(default=4096, ge=16)  # tokens
    kv_cache_gib: float = Field(default=1.0, gt=0)  # vLLM's KV cache (VLLM_CPU_KVCACHE_SPACE)
    cpu_threads_bind: str | None = None  # VLLM_CPU_OMP_THREADS_BIND, e.g. "0-1"; None: inherited / vLLM's default
    log: str | None = None  # the server's output; None: a file in a new temporary folder (logged at start)
    # prefill: ship each layer as it is computed, or the whole KV after the forward; auto:
    # after the forward to a loopback decode region, layer by layer to any other (engine/vllm/params.py)
    ship: Literal["auto", "layerwise", "after_forward"] = "auto"
    # vLLM's automatic prefix caching, each request scoped by its cache salt; the region publishes what the
    # server holds as far as it can tell (engine/prefix_cache.py `ResidencyMirror`)
    prefix_caching: bool = True


class RegionConfig(BaseSettings):
    """Everything one region process needs. Units: bytes, seconds, USD."""

    # allow_inf_nan: `inf` reads as a number in YAML; an infinite price, drain or lease is never meant
    model_config = SettingsConfigDict(
        env_prefix="PRFAAS_", env_nested_delimiter="__", extra="forbid", allow_inf_nan=False
    )

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9-]{0,62}$")
    role: Literal["prefill", "decode", "both"]
    gpu_type: str = "cpu"
    workers: int = Field(default=1, ge=1, le=256)
    usd_per_gpu_hour: float = Field(default=0.0, ge=0.0)
    listen: Listen = Field(default_factory=Listen)
    control_plane_url: str | None = None  # gRPC target of the registry (host:port); None = no heartbeats
    engine: Literal["hf", "vllm"] = "hf"  # vllm: a vLLM server beside the region (the `vllm` section)
    vllm: VLLMOptions = Field(default_factory=VLLMOptions)
    model: str = "smollm2-135m"  # catalog name or HF model folder
    # auto: bfloat16 on a GPU, float32 on the CPU; device auto: CUDA when torch sees a GPU (engine/device.py)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: str = Field(default="auto", pattern=r"^(auto|cpu|cuda(:[0-9]+)?)$")
    # pinned host memory a GPU region's KV passes through on its way out of (prefill) or into (decode) device
    # memory (engine/staging.py, engine/upload.py)
    staging_bytes: int = Field(default=2 << 30, ge=1 << 20)
    # CPUs the HF engine's forward passes run on (the forward's thread is pinned to them for
    # each pass); the region's other threads keep off them. None: no pinning. On a CPU host
    # this keeps the KV shipment's threads from taking the forward's core, as a GPU would.
    engine_cpus: list[int] | None = Field(default=None, min_length=1)
    kv_buffer_bytes: int = Field(default=4 << 30, gt=0)
    ticket_key: str = Field(min_length=32, repr=False)  # HMAC key the control plane signs tickets with
    ticket_key_id: str = "k1"
    # More keys accepted on tickets (key id -> key), for rotating the control plane's key without
    # a window: regions accept the new key first, then the control plane signs with it, then the
    # old one goes (docs/deploy.md). PRFAAS_TICKET_KEYS_ACCEPTED='{"k2": "..."}'.
    ticket_keys_accepted: dict[str, str] = Field(default_factory=dict, repr=False)
    dev: bool = False  # allows placeholder secrets
    queue_depth: int = Field(default=8, ge=0, le=10_000)  # prefill jobs waiting beyond `workers`
    # the codec when a request names none (docs/wire-format.md, "Codec ids")
    codec: Literal["raw", "lossless", "fp8", "int8", "kv8", "kv6", "kv4", "kvw6", "kvw4"] = "lossless"
    kv_lease_s: float = Field(default=30.0, gt=0, le=3600)  # finished KV kept for Reship
    kv_lease_bytes: int = Field(default=2 << 30, ge=0)  # most leased KV bytes; oldest leases go first
    # The HF engine's prefix cache (engine/prefix_cache.py), both roles: prompt blocks kept for
    # reuse, least recently used out past `prefix_cache_bytes` (0: no cache). The block size must
    # be the control plane's `prefix_block_tokens`, or the region's blocks never match a prompt's.
    prefix_cache_bytes: int = Field(default=512 << 20, ge=0)
    prefix_block_tokens: int = Field(default=64, ge=1, le=4096)
    # at least 50 ms: shorter spins the heartbeat thread; at most the registry's MAX_HEARTBEAT_INTERVAL_S
    heartbeat_interval_s: float = Field(default=1.0, ge=0.05, le=60)
    # at most the longest deadline a region call may have (region/requests.py MAX_TIMEOUT_S): a prefill
    # that fills the reservation never runs longer
    max_reservation_s: float = Field(default=600.0, gt=0, le=3600)
    # Decode role: split reservations plus local Generate jobs held at once; past it Reserve and Generate are
    # RESOURCE_EXHAUSTED. Each holds a gRPC thread while it waits (the server's pool counts them in), so
    # health checks, Reserve and Cancel always find a thread.
    max_jobs: int = Field(default=64, ge=1, le=4096)
    drain_timeout_s: float = Field(default=30.0, ge=0, le=3600)
    # How senders reach this decode region's KV: `tcp` (listen.kv), or `webrtc` for a region
    # that accepts no inbound TCP (data channels, signalled through control_plane_url).
    transport: Literal["tcp", "webrtc"] = "tcp"
    # Also offer shared memory to senders on this host and network namespace (chosen by them
    # automatically); the arena is the memory KV lands in, faulted in at start. Opt-in for now:
    # four concurrent split prefills over it hung until their 120 s deadline once in a CI run
    # (not reproduced; docs/transports.md), so regions default to TCP until that is understood.
    shm: bool = False
    shm_arena_bytes: int = Field(default=256 << 20, ge=1 << 20)
    ice_servers: list[IceServerConfig] = Field(default_factory=list)  # webrtc, both roles
    # This instance of the region (a region is a pool of instances, each registered on its own)
    # and the address peers dial it at; None: the listen host, or where the route to the
    # registry leaves this host when the listen host is a wildcard (region/addresses.py).
    instance: str = Field(default_factory=lambda: _host_instance(), pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
    advertise: str | None = None
    # Mutual TLS on every connection (gRPC both ways, KV): `prfaas certs init --identity
    # prfaas://ROLE/NAME/INSTANCE` (or `/*`, shared by the region's instances). Without it, only
    # loopback listen addresses are allowed unless `insecure: true`.
    tls: TlsFiles | None = None
    insecure: bool = False
    # TEST ONLY: a prefill waits this long after each layer, so fault tests can act mid-prefill
    test_layer_delay_s: float = Field(default=0.0, ge=0.0, le=10.0)
    # TEST ONLY: a decode waits this long after each token, so fault tests can act mid-stream
    test_token_delay_s: float = Field(default=0.0, ge=0.0, le=10.0)

    @field_validator("kv_buffer_bytes", "kv_lease_bytes", "shm_arena_bytes", "prefix_cache_bytes", mode="before")
    @classmethod
    def _size(cls, value: object) -> int:
        return parse_bytes(value)

    @field_validator("engine_cpus")
    @classmethod
    def _cpus(cls, value: list[int] | None) -> list[int] | None:
        if value is None:
            return None
        count = os.cpu_count() or 1  # all of the machine's: the region itself may start pinned elsewhere
        unknown = sorted(c for c in set(value) if not 0 <= c < count)
        if unknown:
            raise ValueError(f"CPUs {unknown} do not exist here (0-{count - 1})")
        return sorted(set(value))

    @field_validator("control_plane_url")
    @classmethod
    def _target(cls, value: str | None) -> str | None:
        if value is None:
            return None
        target = value.removeprefix("grpc://")
        if parse_hostport(target)[1] == 0:  # port 0 picks a free port to listen on; there is none to dial
            raise ValueError(f"{value!r} has port 0: the registry's port is 1-65535")
        return target

    @field_validator("advertise")
    @classmethod
    def _advertise(cls, value: str | None) -> str | None:
        return None if value is None else dialable_host(value)

    @model_validator(mode="after")
    def _webrtc_needs_signalling(self) -> RegionConfig:
        if self.transport == "webrtc" and self.control_plane_url is None:
            raise ValueError("transport 'webrtc' needs control_plane_url: offers and answers travel through it")
        return self

    @model_validator(mode="after")
    def _vllm_over_tcp(self) -> RegionConfig:
        if self.engine == "vllm" and (self.transport != "tcp" or self.shm):
            raise ValueError("engine 'vllm' sends and receives KV over TCP only: set transport: tcp and shm: false")
        if self.engine == "vllm" and self.engine_cpus:
            raise ValueError("engine_cpus pins the HF engine; a vLLM server's cores are vllm.cpu_threads_bind")
        return self

    @model_validator(mode="after")
    def _tls(self) -> RegionConfig:
        if self.tls is None:
            exposed = [f"listen.{k}" for k in ("grpc", "kv") if not is_loopback(getattr(self.listen, k))]
            if exposed and not self.insecure:
                raise ValueError(
                    f"{', '.join(exposed)} not on loopback without tls: set tls (certificates from "
                    "`prfaas certs init`), or insecure: true to serve in plaintext"
                )
            return self
        identity = self.tls.identity
        if identity.kind != self.role or identity.region != self.name or identity.instance not in ("*", self.instance):
            raise ValueError(
                f"tls.cert is for {identity.uri}, this is {self.identity.uri} "
                "(its own instance, or * for every instance of the region)"
            )
        return self

    @model_validator(mode="after")
    def _secrets(self) -> RegionConfig:
        keys = {"ticket_key": self.ticket_key} | {
            f"ticket_keys_accepted.{k}": v for k, v in self.ticket_keys_accepted.items()
        }
        for field, key in keys.items():
            if len(key) < 32:
                raise ValueError(f"{field} is shorter than 32 characters")
            if not self.dev and key.strip().lower().strip("x-_ ") in PLACEHOLDER_KEYS | {""}:
                raise ValueError(f"{field} is a placeholder; set a real secret (or dev: true for development)")
            if not self.dev and len(set(key)) < 8:
                raise ValueError(f"{field} looks like a placeholder (fewer than 8 distinct characters)")
        return self

    @property
    def ticket_keys(self) -> dict[str, bytes]:
        """Every key a ticket may be signed with, by key id."""
        accepted = {kid: key.encode() for kid, key in self.ticket_keys_accepted.items()}
        return accepted | {self.ticket_key_id: self.ticket_key.encode()}

    @property
    def identity(self) -> Identity:
        """Who this region instance is (its certificate names the same, or `*` for its instance)."""
        return Identity(self.role, self.name, self.instance)


def field_errors(exc: ValidationError) -> list[str]:
    """One `field.path[index]: message` line per error of `exc` (a config's bad fields)."""
    lines = []
    for error in exc.errors():
        path = ""
        for part in error["loc"]:
            path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
        message = str(error["msg"]).removeprefix("Value error, ")
        lines.append(f"{path or '(top level)'}: {message}")
    return lines


def read_yaml_mapping(path: Path, what: str, error: type[ValueError]) -> dict[str, Any]:
    """The top-level mapping of the YAML file `path`; `error` names the file and `what` it
    should hold when it cannot be read, is not YAML, or is not a mapping."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise error(f"{path}: cannot read the {what}: {exc.strerror}") from None
    return yaml_mapping(text, str(path), what, error)


def yaml_mapping(text: str, source: str, what: str, error: type[ValueError]) -> dict[str, Any]:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise error(f"{source}: not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise error(f"{source}: a {what} is a YAML mapping of fields")
    return data


def config_from_mapping(data: dict[str, Any], source: str = "config") -> RegionConfig:
    try:
        return RegionConfig(**data)
    except ValidationError as exc:
        raise ConfigError(f"{source}: invalid region config:\n  " + "\n  ".join(field_errors(exc))) from None


def load_config(path: str | Path) -> RegionConfig:
    """Read and validate a region YAML file; ConfigError names the file and each bad field."""
    path = Path(path)
    return config_from_mapping(read_yaml_mapping(path, "region config", ConfigError), str(path))


def ice_servers(config: RegionConfig) -> tuple[IceServer, ...]:
    """The config's STUN / TURN servers for `transport: webrtc` (both roles)."""
    return tuple(IceServer(tuple(s.urls), s.username, s.credential) for s in config.ice_servers)
