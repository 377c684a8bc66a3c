"""A deployment topology: the YAML file `prfaas up --topology FILE` starts (docs/operations.md).

`load_topology(path)` / `parse_topology(text)` return a validated `Topology` or raise
`TopologyError`, whose message names the file and each bad field (`regions[1].role: ...`).
Units: rtt in ms, link rate in Mbit/s, loss in percent, prices in USD.
"""

from __future__ import annotations

import secrets
import socket
from pathlib import Path
from typing import Any, Literal, Self

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource

from prfaas.region.config import RegionConfig, dialable_host, field_errors, parse_bytes

DEFAULT_TOPOLOGY = Path(__file__).resolve().parents[1] / "examples" / "topology.yaml"
_NAME = r"^[a-z0-9][a-z0-9-]{0,62}$"


class TopologyError(ValueError):
    """A topology file that cannot be used; the message names the file and the field."""


class _Strict(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ControlPlaneSpec(_Strict):
    host: str = Field(default="127.0.0.1", description="address the HTTP API listens on")
    api_port: int = Field(default=0, ge=0, le=65535, description="0 picks a free port")
    registry_port: int = Field(default=0, ge=0, le=65535, description="region registry gRPC port; 0 picks one")
    workers: int = Field(default=1, ge=1, le=16, description="Celery worker processes")
    worker_concurrency: int = Field(default=4, ge=1, le=256, description="threads per Celery worker")
    ttft_slo_ms: float | None = Field(default=None, gt=0, description="SLO handed to the scheduler")
    shutdown_timeout_s: float = Field(
        default=20.0, ge=0, le=600, description="the API's drain on `prfaas down`: its streams go on this long"
    )

    @field_validator("host")
    @classmethod
    def _listenable(cls, value: str) -> str:
        """An address or name this host can listen on (checked here, not once Redis and the rest started)."""
        if value not in ("0.0.0.0", "::"):  # a wildcard listens on every address (and dials this host)
            value = dialable_host(value)
        try:
            family, kind, proto, _, address = socket.getaddrinfo(value, 0, type=socket.SOCK_STREAM)[0]
            with socket.socket(family, kind, proto) as s:
                s.bind(address)
        except OSError as exc:  # gaierror (no such name), EADDRNOTAVAIL (an address of another host)
            raise ValueError(f"{value!r}: the API cannot listen there on this host ({exc.strerror or exc})") from None
        return value


class PolicySpec(_Strict):
    """The scheduler policy: the built-in one (control_plane/policy.py) with overrides, or a file."""

    path: Path | None = Field(default=None, description="a policy YAML (docs/scheduler.md); wins over the rest")
    min_uncached_tokens: int | None = Field(default=None, ge=0, description="split threshold of the built-in policy")


class TenantSpec(_Strict):
    name: str = Field(default="demo", min_length=1, max_length=128)
    rps: float = Field(default=50.0, gt=0)
    concurrency: int = Field(default=64, ge=1)
    budget_usd: float = Field(default=1000.0, ge=0)
    allow_placement: bool = Field(default=True, description="lets `prfaas bench --compare` ask for a placement")


class RegionSpec(_Strict):
    name: str = Field(pattern=_NAME)
    role: Literal["prefill", "decode", "both"]
    gpu_type: str = Field(default="cpu", min_length=1)
    usd_per_gpu_hour: float = Field(ge=0, allow_inf_nan=False)
    workers: int = Field(default=1, ge=1, le=256)
    instances: int = Field(default=1, ge=1, le=8, description="instances of the region (processes; hosts with --hosts)")
    codec: Literal["raw", "lossless", "fp8", "int8", "kv8", "kv6", "kv4", "kvw6", "kvw4"] = "raw"
    kv_buffer_bytes: int | str = Field(default="1GiB", description="decode KV buffer: bytes or '1GiB'")
    extra: dict[str, Any] = Field(default_factory=dict, description="more region config fields (docs/regions.md)")

    @field_validator("kv_buffer_bytes")
    @classmethod
    def _byte_count(cls, value: int | str) -> int | str:  # refused here, not by the region once all else started
        if parse_bytes(value) <= 0:
            raise ValueError("must be more than 0 bytes")
        return value


class LinkSpec(_Strict):
    """A directed prefill -> decode path. Emulated with `--emulate-wan`; always told to the scheduler."""

    src: str = Field(pattern=_NAME)
    dst: str = Field(pattern=_NAME)
    rtt_ms: float = Field(ge=0, le=10_000, allow_inf_nan=False)
    rate_mbit: float = Field(gt=0, le=1_000_000, allow_inf_nan=False, description="link rate, Mbit/s")
    loss_pct: float = Field(default=0.0, ge=0, lt=100, allow_inf_nan=False)
    egress_usd_per_gb: float = Field(default=0.0, ge=0, allow_inf_nan=False)


class Topology(_Strict):
    name: str = Field(default="prfaas", pattern=_NAME)
    model: str = Field(default="tiny-llama", min_length=1, description="catalog name or HF folder, every region")
    control_plane: ControlPlaneSpec = Field(default_factory=ControlPlaneSpec)
    policy: PolicySpec = Field(default_factory=PolicySpec)
    tenant: TenantSpec = Field(default_factory=TenantSpec)
    regions: list[RegionSpec] = Field(min_length=1)
    links: list[LinkSpec] = Field(default_factory=list)
    restarts: int = Field(
        default=5, ge=0, le=100,
        description="a process that crashes is started again by a foreground `prfaas up`, at most this many times "
        "in 10 minutes (devstack/supervise.py); 0: never",
    )  # fmt: skip

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        names = [r.name for r in self.regions]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"region names repeat: {', '.join(repeated)}")
        if not any(r.role in ("decode", "both") for r in self.regions):
            raise ValueError("no region can decode: at least one needs role decode or both")
        roles = {r.name: r.role for r in self.regions}
        seen: set[tuple[str, str]] = set()
        for i, link in enumerate(self.links):
            for end, want in (("src", ("prefill", "both")), ("dst", ("decode", "both"))):
                name = getattr(link, end)
                if name not in roles:
                    raise ValueError(f"links[{i}].{end}: no region named {name!r} (regions: {', '.join(names)})")
                if roles[name] not in want:
                    raise ValueError(f"links[{i}].{end}: region {name!r} has role {roles[name]}, not {'/'.join(want)}")
            if link.src == link.dst:
                raise ValueError(f"links[{i}]: a link from {link.src!r} to itself")
            if (link.src, link.dst) in seen:
                raise ValueError(f"links[{i}]: a second link {link.src} -> {link.dst}")
            seen.add((link.src, link.dst))
        for i, spec in enumerate(self.regions):
            errors = _extra_errors(self, spec, f"regions[{i}]")
            if errors:
                raise ValueError("\n  ".join(errors))
        return self

    def link(self, src: str, dst: str) -> LinkSpec | None:
        return next((x for x in self.links if (x.src, x.dst) == (src, dst)), None)


def region_config(topology: Topology, spec: RegionSpec, **given: Any) -> dict[str, Any]:
    """The region config `prfaas up` writes for an instance of `spec`: the topology's fields, `given` (the
    instance, its listen addresses, keys, registry), then the region's `extra` over them."""
    return {
        "name": spec.name, "role": spec.role, "gpu_type": spec.gpu_type, "usd_per_gpu_hour": spec.usd_per_gpu_hour,
        "workers": spec.workers, "codec": spec.codec, "kv_buffer_bytes": spec.kv_buffer_bytes,
        "model": topology.model, "heartbeat_interval_s": 1.0, "drain_timeout_s": 3.0, **given,
    } | spec.extra  # fmt: skip


class _AsWritten(RegionConfig):
    """A region config as its file says, the environment not read (`PRFAAS_*` of the process loading the topology
    is not the region's: `up` writes every field a region needs)."""

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings,)


def _extra_errors(topology: Topology, spec: RegionSpec, where: str) -> list[str]:
    """What is wrong with `spec.extra` as the region config `prfaas up` would write (checked at load, not by the
    region once everything else started), each line naming `where.extra.FIELD`."""
    if not spec.extra:
        return []
    given = {"instance": "0", "ticket_key": secrets.token_urlsafe(32), "ticket_key_id": "k1", "insecure": True,
             "listen": {"grpc": "127.0.0.1:0", "kv": "127.0.0.1:0"}, "control_plane_url": "127.0.0.1:1"}  # fmt: skip
    try:
        _AsWritten(**region_config(topology, spec, **given))
    except ValidationError as exc:
        lines = []
        for error, line in zip(exc.errors(), field_errors(exc), strict=True):
            if error["loc"] and error["loc"][0] in spec.extra:
                lines.append(f"{where}.extra.{line}")
            elif not error["loc"]:  # a rule across fields (engine vllm needs transport tcp): one of extra's
                lines.append(f"{where}.extra: {line.removeprefix('(top level): ')}")
            else:
                lines.append(f"{where}: {line}")
        return lines
    return []


def topology_from_mapping(data: dict[str, Any], source: str = "topology") -> Topology:
    try:
        return Topology(**data)
    except ValidationError as exc:
        lines = [line.removeprefix("(top level): ") for line in field_errors(exc)]  # they name their fields
        raise TopologyError(f"{source}: invalid topology:\n  " + "\n  ".join(lines)) from None


def parse_topology(text: str, source: str = "topology") -> Topology:
    return topology_from_mapping(_yaml_mapping(text, source), source)


def _yaml_mapping(text: str, source: str) -> dict[str, Any]:
    """The file's top-level mapping; a YAML error is one line: what is wrong and where."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = "" if mark is None else f" (line {mark.line + 1}, column {mark.column + 1})"
        what = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise TopologyError(f"{source}: not valid YAML: {what}{where}") from None
    if not isinstance(data, dict):
        raise TopologyError(f"{source}: a topology is a YAML mapping of fields")
    return data


def load_topology(path: str | Path) -> Topology:
    """Read and validate a topology file; `TopologyError` names the file and each bad field."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise TopologyError(f"{path}: cannot read the topology: {exc.strerror}") from None
    except UnicodeDecodeError as exc:  # a binary file: one line, not a traceback
        raise TopologyError(f"{path}: not UTF-8 text (byte {exc.start}); a topology is a YAML file") from None
    topology = parse_topology(text, str(path))
    if topology.policy.path is not None and not topology.policy.path.is_absolute():
        policy = topology.policy.model_copy(update={"path": (path.parent / topology.policy.path).resolve()})
        topology = topology.model_copy(update={"policy": policy})
    return topology


def split_topology(
    name: str,
    model: str,
    regions: list[dict[str, Any]],
    links: list[dict[str, Any]],
    *,
    workers: int = 1,
    worker_concurrency: int = 4,
    budget_usd: float = 1000.0,
) -> Topology:
    """The benchmarks' deployments: prompts split from 128 uncached tokens on (the built-in policy's
    threshold keeps prompts of a few hundred tokens local), one tenant named after the deployment
    (default rate limits, `budget_usd` a month); `regions` and `links` as a topology file lists them."""
    return topology_from_mapping(
        {
            "name": name,
            "model": model,
            "control_plane": {"workers": workers, "worker_concurrency": worker_concurrency},
            "policy": {"min_uncached_tokens": 128},
            "tenant": {"name": name, "budget_usd": budget_usd},
            "regions": regions,
            "links": links,
        },
        name,
    )


def write_topology(topology: Topology, path: Path) -> None:
    """`topology` as a file that `load_topology` reads back the same."""
    path.write_text(yaml.safe_dump(topology.model_dump(mode="json"), sort_keys=False))
