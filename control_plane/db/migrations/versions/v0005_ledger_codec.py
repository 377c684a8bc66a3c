"""Ledger: the KV codec each billed job's shipment used (empty for a local job).

Revision ID: 0005_ledger_codec
Revises: 0004_tenant_objectives
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005_ledger_codec"
down_revision: str | None = "0004_tenant_objectives"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    with op.batch_alter_table("ledger_usage") as batch:
        batch.add_column(sa.Column("codec", sa.String(16), nullable=False, server_default=""))


def downgrade() -> None:
    with op.batch_alter_table("ledger_usage") as batch:
        batch.drop_column("codec")
