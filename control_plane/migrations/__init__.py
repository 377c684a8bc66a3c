"""Alembic migrations of the usage ledger, configured in code (no alembic.ini): `upgrade(url)` brings a
database to head and is idempotent. From a shell: `python -m prfaas.control_plane.migrations URL`."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy.engine import Engine

HERE = Path(__file__).resolve().parent


def alembic_config(url: str) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(HERE))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def upgrade(url: str, *, engine: Engine | None = None, revision: str = "head") -> None:
    """Bring the database at `url` (through `engine` when given: its connect hooks, e.g. a search_path,
    apply) to `revision`."""
    from prfaas.control_plane.ledger import make_engine

    cfg = alembic_config(url)
    own = engine is None
    eng = make_engine(url) if engine is None else engine
    try:
        with eng.begin() as conn:
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, revision)
    finally:
        if own:
            eng.dispose()


def current(engine: Engine) -> str | None:
    from alembic.runtime.migration import MigrationContext

    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


if __name__ == "__main__":
    import sys

    upgrade(sys.argv[1])
