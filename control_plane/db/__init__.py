"""prfaas.control_plane.db: the control plane's SQL database, the durable half of its state.

It holds what must outlive any Redis: the usage ledger (billing/models.py) and the tenants, their API keys,
quotas and budgets (tenants/models.py). Redis keeps the hot state beside it (jobs, rate windows, the cache
of tenants and keys). SQLite for one host (`prfaas up`: under $PRFAAS_HOME per deployment), PostgreSQL in
production, chosen by `PRFAAS_LEDGER_URL`.

    engine.py       make_engine: SQLite (WAL) or PostgreSQL by URL, an optional PostgreSQL schema
    base.py         the declarative Base every table derives from, shared column types
    migrations/     Alembic, configured in code: `upgrade(url)` brings a database to head
"""

from prfaas.control_plane.db.base import Base
from prfaas.control_plane.db.engine import make_engine

__all__ = ["Base", "make_engine"]
