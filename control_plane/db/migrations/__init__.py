"""Alembic migrations of the control plane's database (the ledger, the tenants), configured in code (no
alembic.ini): `upgrade(url)` brings a database to head and is idempotent. From a shell:
`python -m prfaas.control_plane.db.migrations URL`."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import MetaData, text
from sqlalchemy.engine import Engine

from prfaas.control_plane.db.engine import make_engine

HERE = Path(__file__).resolve().parent


def target_metadata() -> MetaData:
    """Every table the migrations make: the ledger's, the tenants' and the links' (each module registers its own)."""
    from prfaas.control_plane.billing import models as _ledger  # noqa: F401
    from prfaas.control_plane.db.base import Base
    from prfaas.control_plane.fleet import link_rows as _links  # noqa: F401
    from prfaas.control_plane.tenants import models as _tenants  # noqa: F401

    return Base.metadata


def alembic_config(url: str) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(HERE))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def upgrade(url: str, *, engine: Engine | None = None, revision: str = "head") -> None:
    """Bring the database at `url` (through `engine` when given: its connect hooks, e.g. a search_path,
    apply) to `revision`."""
    cfg = alembic_config(url)
    own = engine is None
    eng = make_engine(url) if engine is None else engine
    try:
        # Processes starting together (an API process and a worker) migrate one at a time: a file lock beside
        # a SQLite database, a transaction-scoped advisory lock on PostgreSQL.
        with _migration_lock(eng), eng.begin() as conn:
            if eng.dialect.name == "postgresql":
                # a migration may wait longer than a request's statement (another process's migration, a lock
                # an ALTER needs), as the SQLite file lock does: 60 s, then the process fails to start
                conn.execute(text("SET LOCAL statement_timeout = '120s'"))
                conn.execute(text("SET LOCAL lock_timeout = '60s'"))
                conn.execute(text("SELECT pg_advisory_xact_lock(7274727)"))
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, revision)
    finally:
        if own:
            eng.dispose()


def _migration_lock(engine: Engine) -> AbstractContextManager[object]:
    database = engine.url.database
    if engine.dialect.name == "sqlite" and database and database != ":memory:":
        from filelock import FileLock

        return FileLock(database + ".migrate.lock", timeout=60)
    return nullcontext()


def current(engine: Engine) -> str | None:
    from alembic.runtime.migration import MigrationContext

    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


if __name__ == "__main__":
    import sys

    upgrade(sys.argv[1])
