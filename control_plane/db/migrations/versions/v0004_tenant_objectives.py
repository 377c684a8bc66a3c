"""Tenants: the defaults of their requests' objectives (TTFT and TPOT objectives, the KV codec consented to).

Revision ID: 0004_tenant_objectives
Revises: 0003_tenants
"""

from __future__ import annotations

import sqlalchemy as sa

from prfaas.control_plane.db.migrations.columns import added_columns

revision = "0004_tenant_objectives"
down_revision: str | None = "0003_tenants"

COLUMNS = (
    sa.Column("ttft_slo_ms", sa.Float(), nullable=True),
    sa.Column("tpot_slo_ms", sa.Float(), nullable=True),
    sa.Column("kv_codec", sa.String(32), nullable=True),
)
upgrade, downgrade = added_columns("tenants", COLUMNS)
