"""The control plane's database connection: `make_engine(url, schema)`. SQLite (embedded, the default) or
PostgreSQL by URL; the schema is brought to head by the Alembic migrations (`db/migrations`).

Every wait on the database is bounded: SQLite waits for its lock up to 30 s; PostgreSQL's connection gives up
after `CONNECT_TIMEOUT_S`, a statement after `STATEMENT_TIMEOUT_S`, a lock wait after `LOCK_TIMEOUT_S`, and a dead
peer is found by TCP keepalives within a minute. Before, a server that took the connection and never answered,
or a table locked by a migration, held an API request's thread for good (an uncached API key is looked up on
the request path). A timeout raises sqlalchemy's OperationalError: the API answers 503 `database_unavailable`.
The URL's own `options` (e.g. `?options=-c statement_timeout=5000`) win over these."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, event
from sqlalchemy.engine import Engine, make_url

CONNECT_TIMEOUT_S = 10
STATEMENT_TIMEOUT_S = 30.0
LOCK_TIMEOUT_S = 10.0
POOL_TIMEOUT_S = 30.0  # waiting for a free connection of the pool


def make_engine(url: str, schema: str | None = None) -> Engine:
    """An engine for `url`; `schema` (PostgreSQL only) puts every table, the Alembic version table included,
    in that schema through the connection's search_path."""
    kwargs: dict[str, Any] = {}
    if url.startswith("sqlite"):
        kwargs["connect_args"] = {"timeout": 30, "check_same_thread": False}
        path = url.split("///", 1)[1] if "///" in url else ""
        if path and path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
    elif url.startswith("postgresql"):
        kwargs["connect_args"] = _postgres_bounds(url)
        kwargs["pool_timeout"] = POOL_TIMEOUT_S
    engine = create_engine(url, **kwargs)
    if engine.dialect.name == "sqlite":

        @event.listens_for(engine, "connect")
        def _wal(dbapi_conn: Any, _record: Any) -> None:
            # WAL: readers (usage pages) never block the writer; synchronous=NORMAL fsyncs at
            # checkpoints, not at every commit (a rollback-journal commit cost ~10 ms of fsync
            # per billed job). A crash may drop the last commits, never corrupts the file, and
            # the reconciliation sweep bills those jobs again from Redis (idempotent).
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.close()

    if schema is not None:
        if engine.dialect.name != "postgresql":
            raise ValueError("a database schema is only supported on PostgreSQL")

        @event.listens_for(engine, "connect")
        def _search_path(dbapi_conn: Any, _record: Any) -> None:
            cur = dbapi_conn.cursor()
            cur.execute(f'SET search_path TO "{schema}"')
            cur.close()
            dbapi_conn.commit()

    return engine


def _postgres_bounds(url: str) -> dict[str, Any]:
    """libpq parameters bounding the connection, each statement and each lock wait (the module docstring)."""
    bounds: dict[str, Any] = {
        "connect_timeout": CONNECT_TIMEOUT_S,
        "keepalives": 1, "keepalives_idle": 30, "keepalives_interval": 10, "keepalives_count": 3,
    }  # fmt: skip
    if "options" not in make_url(url).query:
        statement_ms, lock_ms = int(STATEMENT_TIMEOUT_S * 1000), int(LOCK_TIMEOUT_S * 1000)
        bounds["options"] = f"-c statement_timeout={statement_ms} -c lock_timeout={lock_ms}"
    return bounds
