"""Ledger: usage entries (one per job) and wasted attempts.

Revision ID: 0001_ledger
Revises:
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from alembic import op

revision = "0001_ledger"
down_revision: str | None = None
branch_labels: str | None = None
depends_on: str | None = None


def _required(type_: sa.types.TypeEngine[Any], *names: str) -> list[sa.Column[Any]]:
    """NOT NULL columns of one type, in the order given."""
    return [sa.Column(name, type_, nullable=False) for name in names]


def upgrade() -> None:
    money = ("prefill_usd", "decode_usd", "egress_usd", "total_usd", "colocated_usd", "savings_usd")
    op.create_table(
        "ledger_usage",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        *_required(sa.String(64), "job_id"),
        *_required(sa.String(128), "tenant"),
        *_required(sa.String(256), "model"),
        *_required(sa.String(128), "prefill_region", "decode_region"),
        *_required(sa.DateTime(), "finished_at"),
        *_required(sa.Float(), "prefill_gpu_s", "decode_gpu_s", "colocated_prefill_gpu_s"),
        *_required(sa.Float(), "prefill_usd_per_gpu_h", "decode_usd_per_gpu_h", "egress_usd_per_gb"),
        *_required(sa.BigInteger(), "tokens_in", "tokens_out", "kv_bytes_raw", "kv_bytes_wire"),
        *_required(sa.Float(), *money),
        sa.UniqueConstraint("job_id", name="uq_ledger_usage_job_id"),
    )
    op.create_index("ix_ledger_usage_tenant", "ledger_usage", ["tenant"])
    op.create_index("ix_ledger_usage_finished_at", "ledger_usage", ["finished_at"])
    op.create_table(
        "ledger_wasted",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        *_required(sa.String(64), "job_id"),
        *_required(sa.Integer(), "attempt"),
        *_required(sa.String(16), "phase"),
        *_required(sa.String(128), "tenant", "region"),
        *_required(sa.DateTime(), "recorded_at"),
        *_required(sa.Float(), "gpu_s", "usd_per_gpu_h", "cost_usd"),
        *_required(sa.String(512), "reason"),
        sa.UniqueConstraint("job_id", "attempt", "phase", name="uq_ledger_wasted_attempt"),
    )
    op.create_index("ix_ledger_wasted_job_id", "ledger_wasted", ["job_id"])
    op.create_index("ix_ledger_wasted_recorded_at", "ledger_wasted", ["recorded_at"])


def downgrade() -> None:
    op.drop_table("ledger_wasted")
    op.drop_table("ledger_usage")
