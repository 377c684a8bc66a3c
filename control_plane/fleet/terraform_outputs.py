"""What a Terraform environment tells the registry (`prfaas regions import FILE`): the entries it
describes, read from `terraform output -json` (terraform/envs/*: outputs `regions`, `links`
and `control_plane`; docs/deploy.md).

Regions register themselves over gRPC when they start; what an operator configures is the
links between them (RTT, bandwidth, egress price). `parse_outputs` validates the whole file
and returns typed entries; `apply` puts every link through the admin API and reports which
of the environment's regions have registered so far. Any problem with the file is an
`OutputsError` naming the output and the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

import httpx
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from prfaas.control_plane.scheduling.snapshot import Link


class OutputsError(ValueError):
    """The file is not usable `terraform output -json` of a prfaas environment."""


class RegionEntry(BaseModel):
    """One region as the environment deployed it (terraform/modules/region_*: output `region`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9-]{0,62}$")
    role: Literal["prefill", "decode", "both"]
    provider: str = Field(min_length=1)  # "aws", "local"
    location: str = Field(min_length=1)  # cloud region, or the host address
    gpu_type: str = Field(min_length=1)
    instance_type: str | None = None
    usd_per_gpu_hour: float = Field(ge=0, allow_inf_nan=False)
    grpc_endpoint: str | None = None  # None: instances register their own addresses
    kv_endpoint: str | None = None
    cidr: str | None = None  # the region's network (KV traffic from peers arrives from here)


class ControlPlaneEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    api_url: str = Field(pattern=r"^https?://")
    registry_target: str = Field(min_length=1)


@dataclass(frozen=True)
class Deployment:
    regions: tuple[RegionEntry, ...]
    links: tuple[Link, ...]
    control_plane: ControlPlaneEntry | None


@dataclass(frozen=True)
class ImportReport:
    links_put: int
    registered: tuple[str, ...]  # the environment's regions the registry knows and counts healthy
    missing: tuple[str, ...]  # not (yet) registered or not healthy


def _where(prefix: str, exc: ValidationError) -> str:
    first = exc.errors()[0]
    path = ".".join(str(part) for part in (prefix, *first["loc"]))
    return f"{path}: {first['msg']}"


def _value(outputs: dict[str, Any], name: str, required: bool) -> Any:
    if name not in outputs:
        if required:
            raise OutputsError(
                f"no `{name}` output (expected `terraform output -json` of a terraform/envs/* directory)"
            )
        return None
    output = outputs[name]
    if not isinstance(output, dict) or "value" not in output:
        raise OutputsError(f"output `{name}` has no `value` (expected `terraform output -json`, not `-raw`)")
    return output["value"]


def parse_outputs(text: str) -> Deployment:
    """Validate `terraform output -json` and return its registry entries."""
    try:
        outputs = json.loads(text)
    except json.JSONDecodeError as exc:
        raise OutputsError(f"not JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    if not isinstance(outputs, dict):
        raise OutputsError("expected a JSON object of outputs (`terraform output -json`)")
    raw_regions = _value(outputs, "regions", required=True)
    if not isinstance(raw_regions, dict) or not raw_regions:
        raise OutputsError("regions: expected a non-empty object of region name -> entry")
    regions = []
    for key, raw in raw_regions.items():
        try:
            region = RegionEntry.model_validate(raw)
        except ValidationError as exc:
            raise OutputsError(_where(f"regions.{key}", exc)) from None
        if region.name != key:
            raise OutputsError(f"regions.{key}: entry is named {region.name!r}")
        regions.append(region)
    raw_links = _value(outputs, "links", required=False) or []
    if not isinstance(raw_links, list):
        raise OutputsError("links: expected a list of links")
    roles = {r.name: r.role for r in regions}
    links = []
    for i, raw in enumerate(raw_links):
        try:
            link = Link.model_validate(raw)
        except ValidationError as exc:
            raise OutputsError(_where(f"links.{i}", exc)) from None
        if roles.get(link.src) not in ("prefill", "both"):
            raise OutputsError(f"links.{i}.src: {link.src!r} is not a prefill region of this environment")
        if roles.get(link.dst) not in ("decode", "both"):
            raise OutputsError(f"links.{i}.dst: {link.dst!r} is not a decode region of this environment")
        links.append(link)
    raw_cp = _value(outputs, "control_plane", required=False)
    try:
        control_plane = None if raw_cp is None else ControlPlaneEntry.model_validate(raw_cp)
    except ValidationError as exc:
        raise OutputsError(_where("control_plane", exc)) from None
    return Deployment(tuple(regions), tuple(links), control_plane)


def apply(deployment: Deployment, api_url: str, admin_key: str, timeout_s: float = 10.0) -> ImportReport:
    """PUT every link to the control plane's admin API and read which regions registered.
    Raises httpx.HTTPError when the control plane is unreachable or refuses a link."""
    headers = {"Authorization": f"Bearer {admin_key}"}
    with httpx.Client(base_url=api_url.rstrip("/"), headers=headers, timeout=timeout_s) as client:
        for link in deployment.links:
            client.put("/admin/links", json=link.model_dump(exclude={"utilization"})).raise_for_status()
        reply = client.get("/admin/regions")
        reply.raise_for_status()
        healthy = {r["name"] for r in reply.json() if r.get("healthy")}
    names = [r.name for r in deployment.regions]
    return ImportReport(
        links_put=len(deployment.links),
        registered=tuple(n for n in names if n in healthy),
        missing=tuple(n for n in names if n not in healthy),
    )
