"""The control plane's database connection: `make_engine(url, schema)`. SQLite (embedded, the default) or
PostgreSQL by URL; the schema is brought to head by the Alembic migrations (`db/migrations`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, event
from sqlalchemy.engine import Engine


def make_engine(url: str, schema: str | None = None) -> Engine:
    """An engine for `url`; `schema` (PostgreSQL only) puts every table, the Alembic version table included,
    in that schema through the connection's search_path."""
    kwargs: dict[str, Any] = {}
    if url.startswith("sqlite"):
        kwargs["connect_args"] = {"timeout": 30, "check_same_thread": False}
        path = url.split("///", 1)[1] if "///" in url else ""
        if path and path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
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
