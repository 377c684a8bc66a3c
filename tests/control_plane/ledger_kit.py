"""Ledger databases for tests: `db`, an empty database on SQLite and on the local PostgreSQL (skipped when
it does not answer), and `ledger`, a `Ledger` on it (registered in conftest.py)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from prfaas.control_plane.billing.ledger import Ledger

PG_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


def _pg_reachable() -> str | None:
    try:
        eng = sa.create_engine(PG_URL, connect_args={"connect_timeout": 2})
        with eng.connect() as c:
            c.execute(sa.text("select 1"))
        eng.dispose()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None


@pytest.fixture(params=["sqlite", "postgresql"])
def db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, str | None]]:
    """(url, schema) of an empty database."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'ledger.db'}", None
        return
    why = _pg_reachable()
    if why is not None:
        pytest.skip(f"PostgreSQL at {PG_URL} unreachable: {why}")
    schema = f"ledger_test_{uuid.uuid4().hex[:12]}"
    admin = sa.create_engine(PG_URL)
    with admin.begin() as c:
        c.execute(sa.text(f'CREATE SCHEMA "{schema}"'))
    try:
        yield PG_URL, schema
    finally:
        with admin.begin() as c:
            c.execute(sa.text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()


@pytest.fixture
def ledger(db: tuple[str, str | None]) -> Iterator[Ledger]:
    led = Ledger(db[0], schema=db[1])
    yield led
    led.close()
