"""Revisions that add columns to a table already there. Each declares its columns once and takes its
`upgrade` and `downgrade` from `added_columns`, so the downgrade drops exactly what the upgrade added."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import sqlalchemy as sa
from alembic import op

Step = Callable[[], None]  # a revision's `upgrade` or `downgrade`, as alembic calls it


def added_columns(table: str, columns: Sequence[sa.Column[Any]]) -> tuple[Step, Step]:
    """`(upgrade, downgrade)` of a revision that adds `columns` to `table`, in batch mode (SQLite too).

    The upgrade adds them in the order given; the downgrade drops them, the last added first. A NOT NULL
    column needs a `server_default`: the value the rows already there get. The same `Column` objects may be
    applied again (another database, the same process): alembic adds a copy of a column that has a table."""

    def upgrade() -> None:
        with op.batch_alter_table(table) as batch:
            for column in columns:
                batch.add_column(column)

    def downgrade() -> None:
        with op.batch_alter_table(table) as batch:
            for column in reversed(columns):
                batch.drop_column(column.name)

    return upgrade, downgrade
