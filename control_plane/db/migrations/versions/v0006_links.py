"""The operator-set links between regions (`PUT /admin/links`), kept in the database beside the tenants: Redis
holds them for the scheduler, and gets them back from here when it lost its data.

Revision ID: 0006_links
Revises: 0005_ledger_codec
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006_links"
down_revision: str | None = "0005_ledger_codec"


def upgrade() -> None:
    op.create_table(
        "links",
        sa.Column("src", sa.String(64), primary_key=True),
        sa.Column("dst", sa.String(64), primary_key=True),
        sa.Column("spec", sa.String(512), nullable=False),
        sa.Column("updated_at", sa.Float(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("links")
