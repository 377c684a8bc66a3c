"""Alembic environment: runs on the connection `upgrade()` passes (or one made from sqlalchemy.url)."""

from __future__ import annotations

from alembic import context
from sqlalchemy import Connection

from prfaas.control_plane.db.engine import make_engine
from prfaas.control_plane.db.migrations import target_metadata


def _run(conn: Connection) -> None:
    context.configure(connection=conn, target_metadata=target_metadata(), render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()


_conn = context.config.attributes.get("connection")
if _conn is not None:
    _run(_conn)
else:
    _url = context.config.get_main_option("sqlalchemy.url")
    assert _url, "sqlalchemy.url is not set"
    _engine = make_engine(_url)
    try:
        with _engine.begin() as _c:
            _run(_c)
    finally:
        _engine.dispose()
