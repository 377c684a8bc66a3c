"""Ledger: how each billed job was placed and served (placement, attempts, TTFT, TPOT).

Revision ID: 0002_job_metrics
Revises: 0001_ledger
"""

from __future__ import annotations

import sqlalchemy as sa

from prfaas.control_plane.db.migrations.columns import added_columns

revision = "0002_job_metrics"
down_revision: str | None = "0001_ledger"

COLUMNS = (
    sa.Column("placement", sa.String(16), nullable=False, server_default=""),
    sa.Column("attempts", sa.Integer(), nullable=False, server_default="1"),
    sa.Column("ttft_s", sa.Float(), nullable=True),
    sa.Column("tpot_s", sa.Float(), nullable=True),
)
upgrade, downgrade = added_columns("ledger_usage", COLUMNS)
