"""Ledger: usage entries (one per job) and wasted attempts.

Revision ID: 0001_ledger
Revises:
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001_ledger"
down_revision: str | None = None
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    op.create_table(
        "ledger_usage",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("job_id", sa.String(64), nullable=False),
        sa.Column("tenant", sa.String(128), nullable=False),
        sa.Column("model", sa.String(256), nullable=False),
        sa.Column("prefill_region", sa.String(128), nullable=False),
        sa.Column("decode_region", sa.String(128), nullable=False),
        sa.Column("finished_at", sa.DateTime(), nullable=False),
        sa.Column("prefill_gpu_s", sa.Float(), nullable=False),
        sa.Column("decode_gpu_s", sa.Float(), nullable=False),
        sa.Column("colocated_prefill_gpu_s", sa.Float(), nullable=False),
        sa.Column("prefill_usd_per_gpu_h", sa.Float(), nullable=False),
        sa.Column("decode_usd_per_gpu_h", sa.Float(), nullable=False),
        sa.Column("egress_usd_per_gb", sa.Float(), nullable=False),
        sa.Column("tokens_in", sa.BigInteger(), nullable=False),
        sa.Column("tokens_out", sa.BigInteger(), nullable=False),
        sa.Column("kv_bytes_raw", sa.BigInteger(), nullable=False),
        sa.Column("kv_bytes_wire", sa.BigInteger(), nullable=False),
        sa.Column("prefill_usd", sa.Float(), nullable=False),
        sa.Column("decode_usd", sa.Float(), nullable=False),
        sa.Column("egress_usd", sa.Float(), nullable=False),
        sa.Column("total_usd", sa.Float(), nullable=False),
        sa.Column("colocated_usd", sa.Float(), nullable=False),
        sa.Column("savings_usd", sa.Float(), nullable=False),
        sa.UniqueConstraint("job_id", name="uq_ledger_usage_job_id"),
    )
    op.create_index("ix_ledger_usage_tenant", "ledger_usage", ["tenant"])
    op.create_index("ix_ledger_usage_finished_at", "ledger_usage", ["finished_at"])
    op.create_table(
        "ledger_wasted",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("job_id", sa.String(64), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("phase", sa.String(16), nullable=False),
        sa.Column("tenant", sa.String(128), nullable=False),
        sa.Column("region", sa.String(128), nullable=False),
        sa.Column("recorded_at", sa.DateTime(), nullable=False),
        sa.Column("gpu_s", sa.Float(), nullable=False),
        sa.Column("usd_per_gpu_h", sa.Float(), nullable=False),
        sa.Column("cost_usd", sa.Float(), nullable=False),
        sa.Column("reason", sa.String(512), nullable=False),
        sa.UniqueConstraint("job_id", "attempt", "phase", name="uq_ledger_wasted_attempt"),
    )
    op.create_index("ix_ledger_wasted_job_id", "ledger_wasted", ["job_id"])
    op.create_index("ix_ledger_wasted_recorded_at", "ledger_wasted", ["recorded_at"])


def downgrade() -> None:
    op.drop_table("ledger_wasted")
    op.drop_table("ledger_usage")
