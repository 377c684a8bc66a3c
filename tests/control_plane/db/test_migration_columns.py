"""The revisions that add columns (db/migrations/columns.py), on a SQLite file: each upgrade adds exactly the
columns its revision declares, in order, and its downgrade drops exactly those, back to the schema below."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import sqlalchemy as sa
from alembic import command

from prfaas.control_plane.db.migrations import alembic_config, upgrade

ADDED = [  # (revision, the table it adds columns to, the revision below it)
    ("0002_job_metrics", "ledger_usage", "0001_ledger"),
    ("0004_tenant_objectives", "tenants", "0003_tenants"),
    ("0005_ledger_codec", "ledger_usage", "0004_tenant_objectives"),
]


def _columns(url: str, table: str) -> list[str]:
    engine = sa.create_engine(url)
    try:
        return [c["name"] for c in sa.inspect(engine).get_columns(table)]
    finally:
        engine.dispose()


@pytest.mark.parametrize(("revision", "table", "below"), ADDED)
def test_downgrade_drops_exactly_what_the_upgrade_added(tmp_path: Path, revision: str, table: str, below: str) -> None:
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    module = importlib.import_module(f"prfaas.control_plane.db.migrations.versions.v{revision}")
    declared = [column.name for column in module.COLUMNS]
    upgrade(url, revision=below)
    before = _columns(url, table)
    upgrade(url, revision=revision)
    assert _columns(url, table) == before + declared  # added after the existing ones, in the declared order
    command.downgrade(alembic_config(url), below)
    assert _columns(url, table) == before
