"""Regions and links (admin key): list regions with their health and load, drain and undrain one (the
scheduler stops placing work there; running jobs finish), list and set the links between regions."""

from __future__ import annotations

from fastapi import APIRouter, HTTPException
from pydantic import ValidationError

from prfaas.control_plane.api.deps import AdminDep, ServicesDep
from prfaas.control_plane.api.schemas import LinkPublic, RegionPublic
from prfaas.control_plane.fleet.records import RegionNotFound, RegionRecord
from prfaas.control_plane.scheduling.snapshot import Link
from prfaas.control_plane.services import Services

router = APIRouter(prefix="/admin", tags=["admin"], dependencies=[AdminDep])


def _region(r: RegionRecord) -> RegionPublic:
    return RegionPublic.model_validate(r, from_attributes=True)


def _set_drained(s: Services, name: str, drained: bool) -> RegionPublic:
    try:
        return _region(s.regions.set_drained(name, drained))
    except RegionNotFound:
        raise HTTPException(404, "region not found") from None


@router.get("/regions")
def list_regions(s: ServicesDep) -> list[RegionPublic]:
    return [_region(r) for r in s.regions.regions()]


@router.post("/regions/{name}/drain")
def drain_region(name: str, s: ServicesDep) -> RegionPublic:
    return _set_drained(s, name, True)


@router.post("/regions/{name}/undrain")
def undrain_region(name: str, s: ServicesDep) -> RegionPublic:
    return _set_drained(s, name, False)


@router.get("/links")
def list_links(s: ServicesDep) -> list[LinkPublic]:
    return [LinkPublic.model_validate(link.model_dump()) for link in s.regions.links()]


@router.put("/links")
def put_link(body: LinkPublic, s: ServicesDep) -> LinkPublic:
    try:
        s.regions.set_link(Link.model_validate(body.model_dump()))
    except ValidationError:
        raise HTTPException(422, "a link needs two different regions") from None
    return body
