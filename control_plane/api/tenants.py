"""Tenants and their API keys (admin key): create, list, update, suspend; issue, list, revoke keys."""

from __future__ import annotations

from fastapi import APIRouter, HTTPException

from prfaas.control_plane.api.deps import AdminDep, ServicesDep
from prfaas.control_plane.api.errors import UNKNOWN_KV_CODEC
from prfaas.control_plane.api.schemas import ApiKeyIssued, ApiKeyPublic, TenantCreate, TenantPublic, TenantUpdate
from prfaas.control_plane.jobs.objectives import LOSSLESS
from prfaas.control_plane.services import Services
from prfaas.control_plane.tenants import ApiKey, KeyNotFound, Tenant, TenantChanges, TenantNotFound, TenantStatus

router = APIRouter(prefix="/admin", tags=["admin"], dependencies=[AdminDep])


def _tenant(s: Services, t: Tenant) -> TenantPublic:
    return TenantPublic(
        id=t.id, name=t.name, status=t.status.value, rps=t.quota.rps, concurrency=t.quota.concurrency,
        budget_usd=t.quota.budget_usd, allow_placement=t.allow_placement, ttft_slo_ms=t.objectives.ttft_slo_ms,
        tpot_slo_ms=t.objectives.tpot_slo_ms, kv_codec=t.objectives.kv_codec, spend_usd_this_month=s.jobs.spend(t.id),
        reserved_usd=s.jobs.reserved(t.id), active_jobs=s.jobs.active_count(t.id),
    )  # fmt: skip


def _key(k: ApiKey) -> ApiKeyPublic:
    return ApiKeyPublic(id=k.id, tenant=k.tenant, revoked=k.revoked, created_at=k.created_at)


def _codec(s: Services, codec: str | None) -> None:
    if codec is not None and codec != LOSSLESS and codec not in s.lossy_codecs:
        raise UNKNOWN_KV_CODEC.error(param="kv_codec")


@router.post("/tenants", status_code=201)
def create_tenant(body: TenantCreate, s: ServicesDep) -> TenantPublic:
    _codec(s, body.kv_codec)
    limits = TenantChanges(**body.model_dump(exclude={"name"}))
    return _tenant(s, s.tenants.create(body.name, limits))


@router.get("/tenants")
def list_tenants(s: ServicesDep) -> list[TenantPublic]:
    return [_tenant(s, t) for t in s.tenants.all()]


@router.patch("/tenants/{tenant_id}")
def update_tenant(tenant_id: str, body: TenantUpdate, s: ServicesDep) -> TenantPublic:
    _codec(s, body.kv_codec)
    status = None if body.status is None else TenantStatus(body.status)
    try:
        t = s.tenants.update(tenant_id, TenantChanges(**body.model_dump(exclude={"status"}), status=status))
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
