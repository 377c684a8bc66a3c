"""Regions and links (admin key): list regions with their health and load, drain and undrain one (the
scheduler stops placing work there; running jobs finish), list and set the links between regions."""

from __future__ import annotations

from fastapi import APIRouter, HTTPException
from pydantic import ValidationError

from prfaas.control_plane.api.deps import AdminDep, ServicesDep
from prfaas.control_plane.api.schemas import LinkMeasured, LinkPublic, LinkScheduled, LinkView, RegionPublic
from prfaas.control_plane.fleet.links import effective
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
def list_links(s: ServicesDep) -> list[LinkView]:
    now = s.regions.clock()  # the estimates' clock (Redis's), as the scheduler ages them
    estimates = s.regions.link_estimates(now)
    views = []
    for link in s.regions.configured_links():
        estimate = estimates.get((link.src, link.dst))
        scheduled = effective(link, estimate, now) if s.settings.measure_links else link  # what snapshots get
        measured = None
        if estimate is not None:
            measured = LinkMeasured(
                bandwidth_gbps=estimate.measured_gbps, min_rtt_ms=estimate.min_rtt_ms, srtt_ms=estimate.srtt_ms,
                sending_gbps=estimate.sending_bytes_per_s * 8 / 1e9, backlogged_bytes=estimate.backlogged_bytes,
                weight=estimate.weight, retransmits=estimate.retransmits, age_s=estimate.age_s(now),
            )  # fmt: skip
        views.append(LinkView(
            **link.model_dump(include={"src", "dst", "rtt_ms", "bandwidth_gbps", "egress_usd_per_gb"}),
            measured=measured,
            scheduled=LinkScheduled(rtt_ms=scheduled.rtt_ms, bandwidth_gbps=scheduled.bandwidth_gbps,
                                    utilization=scheduled.utilization),
        ))  # fmt: skip
    return views


@router.put("/links")
def put_link(body: LinkPublic, s: ServicesDep) -> LinkPublic:
    """A link may name a region not registered yet (links are set before regions come up); one whose regions
    are registered must lead from a prefill-capable region to a decode-capable one (KV's direction)."""
    try:
        link = Link.model_validate(body.model_dump())
    except ValidationError:
        raise HTTPException(422, "a link needs two different regions") from None
    roles = {r.name: r.role for r in s.regions.regions()}
    for end, name, wanted in (("src", link.src, ("prefill", "both")), ("dst", link.dst, ("decode", "both"))):
        if name in roles and roles[name] not in wanted:
            raise HTTPException(422, f"{end}: region {name!r} has role {roles[name]}, not {'/'.join(wanted)} "
                                     "(a link carries KV from a prefill region to a decode region)")  # fmt: skip
    s.regions.set_link(link)
    return body


@router.delete("/links/{src}/{dst}", status_code=204)
def delete_link(src: str, dst: str, s: ServicesDep) -> None:
    """Remove a configured link (a misspelled one, a path no longer used); its measurements age out."""
    if not s.regions.delete_link(src, dst):
        raise HTTPException(404, "link not found")
