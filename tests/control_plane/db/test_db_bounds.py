"""Every wait on the control plane's PostgreSQL is bounded (db/engine.py): a server that takes the connection and
never answers, and a table another session holds locked (a migration's ALTER TABLE), end in sqlalchemy's
OperationalError (the API's 503 `database_unavailable`) at their timeouts. Before, both blocked for good: an
uncached API key is looked up on the request path. Real PostgreSQL for the lock."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import sqlalchemy as sa
from cp_kit import outcome_within, silent_port
from ledger_kit import PG_URL, _pg_reachable

from prfaas.control_plane.db import engine as db_engine
from prfaas.control_plane.db.engine import make_engine

CUTOFF_S = 15.0  # the test's own bound: a wait still blocked here is unbounded


@pytest.fixture
def silent_server() -> Iterator[int]:
    with silent_port() as port:
        yield port


def test_a_server_that_never_answers_fails_the_connection_at_its_timeout(
    silent_server: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(db_engine, "CONNECT_TIMEOUT_S", 2)
    engine = make_engine(f"postgresql+psycopg://prfaas@127.0.0.1:{silent_server}/test")
    try:
        error, took = outcome_within(lambda: engine.connect().close(), CUTOFF_S)
    finally:
        engine.dispose()
    assert isinstance(error, sa.exc.OperationalError), error
    assert took < 6, took


@pytest.fixture
def pg_schema() -> Iterator[str]:
    why = _pg_reachable()
    if why is not None:
        pytest.skip(f"PostgreSQL at {PG_URL} unreachable: {why}")
    schema = f"bounds_{uuid.uuid4().hex[:10]}"
    admin = sa.create_engine(PG_URL)
    with admin.begin() as c:
        c.execute(sa.text(f'CREATE SCHEMA "{schema}"'))
        c.execute(sa.text(f'CREATE TABLE "{schema}".api_keys (id int)'))
    try:
        yield schema
    finally:
        with admin.begin() as c:
            c.execute(sa.text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()


def test_a_locked_table_fails_the_statement_at_the_lock_timeout(
    pg_schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(db_engine, "LOCK_TIMEOUT_S", 0.5)
    engine = make_engine(PG_URL, pg_schema)
    locker = sa.create_engine(PG_URL)
    try:
        with locker.connect() as held, held.begin():
            held.execute(sa.text(f'LOCK TABLE "{pg_schema}".api_keys IN ACCESS EXCLUSIVE MODE'))  # as ALTER TABLE

            def read() -> None:
                with engine.connect() as conn:
                    conn.execute(sa.text("SELECT count(*) FROM api_keys")).scalar()

            error, took = outcome_within(read, CUTOFF_S)
    finally:
        engine.dispose()
        locker.dispose()
    assert isinstance(error, sa.exc.OperationalError) and "lock timeout" in str(error), error
    assert took < 5, took


def test_a_urls_own_options_win(pg_schema: str) -> None:
    engine = make_engine(PG_URL + "?options=-c%20statement_timeout%3D1234", pg_schema)
    try:
        with engine.connect() as conn:
            assert conn.execute(sa.text("SHOW statement_timeout")).scalar() == "1234ms"
            assert conn.execute(sa.text("SHOW lock_timeout")).scalar() == "0"
    finally:
        engine.dispose()
    engine = make_engine(PG_URL, pg_schema)
    try:
        with engine.connect() as conn:
            assert conn.execute(sa.text("SHOW statement_timeout")).scalar() == "30s"
            assert conn.execute(sa.text("SHOW lock_timeout")).scalar() == "10s"
    finally:
        engine.dispose()
