"""Admin routes (admin key): tenants, API keys, regions, links."""

from __future__ import annotations

from fastapi import APIRouter, HTTPException
from pydantic import ValidationError

from prfaas.control_plane.deps import AdminDep, ServicesDep
from prfaas.control_plane.fleet.registry import RegionNotFound, RegionRecord
from prfaas.control_plane.scheduling.snapshot import Link
from prfaas.control_plane.schemas import (
    ApiKeyIssued,
    ApiKeyPublic,
    LinkPublic,
    RegionPublic,
    TenantCreate,
    TenantPublic,
    TenantUpdate,
)
from prfaas.control_plane.services import Services
from prfaas.control_plane.tenants import ApiKey, KeyNotFound, Tenant, TenantNotFound, TenantStatus

router = APIRouter(prefix="/admin", tags=["admin"], dependencies=[AdminDep])


def _tenant(s: Services, t: Tenant) -> TenantPublic:
    return TenantPublic(
        id=t.id, name=t.name, status=t.status.value, rps=t.quota.rps, concurrency=t.quota.concurrency,
        budget_usd=t.quota.budget_usd, allow_placement=t.allow_placement, spend_usd_this_month=s.jobs.spend(t.id),
        active_jobs=s.jobs.active_count(t.id),
    )  # fmt: skip


def _key(k: ApiKey) -> ApiKeyPublic:
    return ApiKeyPublic(id=k.id, tenant=k.tenant, revoked=k.revoked, created_at=k.created_at)


def _region(r: RegionRecord) -> RegionPublic:
    return RegionPublic(
        name=r.name, role=r.role, gpu_type=r.gpu_type, num_workers=r.num_workers, usd_per_gpu_hour=r.usd_per_gpu_hour,
        grpc_endpoint=r.grpc_endpoint, kv_endpoint=r.kv_endpoint, alive=r.alive, healthy=r.healthy,
        draining=r.draining, drained=r.drained, heartbeat_age_s=r.heartbeat_age_s, queue_depth=r.queue_depth,
        busy_workers=r.busy_workers, kv_used_bytes=r.kv_used_bytes, kv_free_bytes=r.kv_free_bytes,
    )  # fmt: skip


@router.post("/tenants", status_code=201)
def create_tenant(body: TenantCreate, s: ServicesDep) -> TenantPublic:
    t = s.tenants.create(
        body.name, rps=body.rps, concurrency=body.concurrency, budget_usd=body.budget_usd,
        allow_placement=body.allow_placement,
    )  # fmt: skip
    return _tenant(s, t)


@router.get("/tenants")
def list_tenants(s: ServicesDep) -> list[TenantPublic]:
    return [_tenant(s, t) for t in s.tenants.all()]


@router.patch("/tenants/{tenant_id}")
def update_tenant(tenant_id: str, body: TenantUpdate, s: ServicesDep) -> TenantPublic:
    try:
        t = s.tenants.update(
            tenant_id, status=TenantStatus(body.status) if body.status else None, rps=body.rps,
            concurrency=body.concurrency, budget_usd=body.budget_usd, allow_placement=body.allow_placement,
        )  # fmt: skip
    except TenantNotFound:
        raise HTTPException(404, "tenant not found") from None
    return _tenant(s, t)


@router.post("/tenants/{tenant_id}/suspend")
def suspend_tenant(tenant_id: str, s: ServicesDep) -> TenantPublic:
    return update_tenant(tenant_id, TenantUpdate(status="suspended"), s)


@router.post("/tenants/{tenant_id}/keys", status_code=201)
def issue_key(tenant_id: str, s: ServicesDep) -> ApiKeyIssued:
    try:
        k, full = s.tenants.issue_key(tenant_id)
    except TenantNotFound:
        raise HTTPException(404, "tenant not found") from None
    return ApiKeyIssued(id=k.id, tenant=k.tenant, revoked=k.revoked, created_at=k.created_at, key=full)


@router.get("/tenants/{tenant_id}/keys")
def list_keys(tenant_id: str, s: ServicesDep) -> list[ApiKeyPublic]:
    try:
        return [_key(k) for k in s.tenants.list_keys(tenant_id)]
    except TenantNotFound:
        raise HTTPException(404, "tenant not found") from None


@router.delete("/tenants/{tenant_id}/keys/{key_id}")
def revoke_key(tenant_id: str, key_id: str, s: ServicesDep) -> ApiKeyPublic:
    try:
        return _key(s.tenants.revoke_key(tenant_id, key_id))
    except KeyNotFound:
        raise HTTPException(404, "API key not found") from None


@router.get("/regions")
def list_regions(s: ServicesDep) -> list[RegionPublic]:
    return [_region(r) for r in s.regions.regions()]


@router.post("/regions/{name}/drain")
def drain_region(name: str, s: ServicesDep) -> RegionPublic:
    try:
        return _region(s.regions.set_drained(name, True))
    except RegionNotFound:
        raise HTTPException(404, "region not found") from None


@router.post("/regions/{name}/undrain")
def undrain_region(name: str, s: ServicesDep) -> RegionPublic:
    try:
        return _region(s.regions.set_drained(name, False))
    except RegionNotFound:
        raise HTTPException(404, "region not found") from None


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
