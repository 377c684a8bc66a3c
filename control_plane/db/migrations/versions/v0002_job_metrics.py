"""Ledger: how each billed job was placed and served (placement, attempts, TTFT, TPOT).

Revision ID: 0002_job_metrics
Revises: 0001_ledger
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002_job_metrics"
down_revision: str | None = "0001_ledger"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    with op.batch_alter_table("ledger_usage") as batch:
        batch.add_column(sa.Column("placement", sa.String(16), nullable=False, server_default=""))
        batch.add_column(sa.Column("attempts", sa.Integer(), nullable=False, server_default="1"))
        batch.add_column(sa.Column("ttft_s", sa.Float(), nullable=True))
        batch.add_column(sa.Column("tpot_s", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("ledger_usage") as batch:
        for name in ("tpot_s", "ttft_s", "attempts", "placement"):
            batch.drop_column(name)
