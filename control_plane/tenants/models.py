"""The tenants' tables, in the control plane's database beside the ledger (db/; made by the migration
`0003_tenants`): `TenantRow` and `ApiKeyRow`. The database is the truth; Redis holds a cache of it
(tenants/cache.py). Times are epoch seconds (as the API shows them); money in $."""

from __future__ import annotations

from sqlalchemy import ForeignKey, Index, String
from sqlalchemy.orm import Mapped, mapped_column

from prfaas.control_plane.db.base import Base, Str16, Str64, Str128


class TenantRow(Base):
    """One tenant: its name, status and quota. Never deleted (the ledger's rows name it); suspended instead."""

    __tablename__ = "tenants"

    id: Mapped[Str64] = mapped_column(primary_key=True)
    name: Mapped[Str128] = mapped_column(index=True)
    status: Mapped[Str16]  # TenantStatus
    rps: Mapped[float]
    concurrency: Mapped[int]
    budget_usd: Mapped[float]  # per calendar month
    allow_placement: Mapped[bool]
    ttft_slo_ms: Mapped[float | None]  # the defaults of its requests' objectives (migration 0004)
    tpot_slo_ms: Mapped[float | None]
    kv_codec: Mapped[str | None] = mapped_column(String(32))
    created_at: Mapped[float]
    updated_at: Mapped[float]


class ApiKeyRow(Base):
    """One API key of a tenant: the SHA-256 of the full key (never the key), revoked or not."""

    __tablename__ = "api_keys"
    __table_args__ = (Index("ix_api_keys_digest", "digest", unique=True),)

    id: Mapped[Str64] = mapped_column(primary_key=True)
    tenant_id: Mapped[Str64] = mapped_column(ForeignKey("tenants.id"), index=True)
    digest: Mapped[Str64]
    revoked: Mapped[bool]
    created_at: Mapped[float]
    revoked_at: Mapped[float | None]
