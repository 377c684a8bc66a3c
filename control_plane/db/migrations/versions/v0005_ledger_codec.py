"""Ledger: the KV codec each billed job's shipment used (empty for a local job).

Revision ID: 0005_ledger_codec
Revises: 0004_tenant_objectives
"""

from __future__ import annotations

import sqlalchemy as sa

from prfaas.control_plane.db.migrations.columns import added_columns

revision = "0005_ledger_codec"
down_revision: str | None = "0004_tenant_objectives"

COLUMNS = (sa.Column("codec", sa.String(16), nullable=False, server_default=""),)
upgrade, downgrade = added_columns("ledger_usage", COLUMNS)
