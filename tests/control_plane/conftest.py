"""Fixtures shared by several control-plane test modules (defined once here, so a session-scoped one is
started once per run): `metered`, the metered stack of metering_kit.py; `db` and `ledger`, ledger databases
on SQLite and PostgreSQL (ledger_kit.py)."""

from ledger_kit import db, ledger
from metering_kit import metered_fixture

__all__ = ["db", "ledger", "metered_fixture"]
