"""Tenants: the defaults of their requests' objectives (TTFT and TPOT objectives, the KV codec consented to).

Revision ID: 0004_tenant_objectives
Revises: 0003_tenants
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004_tenant_objectives"
down_revision: str | None = "0003_tenants"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    with op.batch_alter_table("tenants") as batch:
        batch.add_column(sa.Column("ttft_slo_ms", sa.Float(), nullable=True))
        batch.add_column(sa.Column("tpot_slo_ms", sa.Float(), nullable=True))
        batch.add_column(sa.Column("kv_codec", sa.String(32), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("tenants") as batch:
        for name in ("kv_codec", "tpot_slo_ms", "ttft_slo_ms"):
            batch.drop_column(name)
