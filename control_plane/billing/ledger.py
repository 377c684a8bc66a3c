"""The usage ledger (a repository over billing/models.py): one billed entry per job, written exactly once, and
wasted attempts recorded separately as the platform's cost; reads of entries, spend and grouped totals.
SQLAlchemy 2.x on the engine of db/engine.py; the schema is brought to head by Alembic
(`db/migrations`) when a `Ledger` starts. Costs come from billing/costs.py (`entry_values`)."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session, sessionmaker

from prfaas.control_plane.billing import queries
from prfaas.control_plane.billing.costs import JobUsage, PriceTable, entry_values, gpu_usd, utc_naive
from prfaas.control_plane.billing.models import UsageEntry, WastedAttempt
from prfaas.control_plane.billing.queries import GroupBy, GroupTotal
from prfaas.control_plane.db.engine import make_engine

IN_CHUNK = 500  # ids per `IN (...)`: well under SQLite's 999 bound parameters of older builds


class Ledger:
    """The ledger at `url` (`Settings.ledger.url`); `schema`: PostgreSQL schema of its tables; `migrate`: bring
    the database to head first (idempotent; processes starting together migrate one at a time); `engine`: one
    already open on `url` (the services', shared with the tenants' store)."""

    def __init__(
        self, url: str, *, schema: str | None = None, migrate: bool = True, engine: Engine | None = None
    ) -> None:
        from prfaas.control_plane.db.migrations import upgrade

        self.url = url
        self.engine = make_engine(self.url, schema) if engine is None else engine
        if migrate:
            upgrade(self.url, engine=self.engine)
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)
        table = UsageEntry.__table__
        self._insert_entries = (
            self._insert(table).on_conflict_do_nothing(index_elements=["job_id"]).returning(table.c.job_id)
        )

    def close(self) -> None:
        self.engine.dispose()

    @contextmanager
    def session(self) -> Iterator[Session]:
        with self._sessions.begin() as s:
            yield s

    def _insert(self, table: Any) -> Any:
        return (pg_insert if self.engine.dialect.name == "postgresql" else sqlite_insert)(table)

    def record(self, usage: JobUsage, prices: PriceTable) -> UsageEntry:
        """Bill a job once: a second call for the same job id returns the stored entry and changes nothing."""
        return self.record_once(usage, prices)[0]

    def record_once(self, usage: JobUsage, prices: PriceTable) -> tuple[UsageEntry, bool]:
        """`record`, and whether this call wrote the entry (False: it was there already)."""
        return self.record_many([(usage, prices)])[0]

    def record_many(self, jobs: Sequence[tuple[JobUsage, PriceTable]]) -> list[tuple[UsageEntry, bool]]:
        """`record_once` for many jobs in one transaction: one `INSERT ... ON CONFLICT DO NOTHING RETURNING
        job_id` over all the rows (the ids it returns are the entries this call wrote) and one read of the
        stored entries, in the order given. A job id given twice is billed once (its second result: not
        written). The statement is the same for every call, so SQLAlchemy compiles it once (rows given as
        parameters, not as `.values(rows)`: that compiled anew for each batch size at ~1 ms a job)."""
        rows: dict[str, dict[str, Any]] = {}
        for usage, prices in jobs:
            rows.setdefault(usage.job_id, entry_values(usage, prices))
        if not rows:
            return []
        with self.session() as s:
            written = set(s.execute(self._insert_entries, list(rows.values())).scalars())
            stored = {e.job_id: e for e in s.scalars(select(UsageEntry).where(UsageEntry.job_id.in_(list(rows))))}
        out = []
        for usage, _ in jobs:
            out.append((stored[usage.job_id], usage.job_id in written))
            written.discard(usage.job_id)
        return out

    def record_wasted(self, **kwargs: Any) -> WastedAttempt:
        """Record an attempt's wasted GPU time once per (job, attempt, phase)."""
        return self.record_wasted_once(**kwargs)[0]

    def record_wasted_once(
        self,
        *,
        job_id: str,
        attempt: int,
        phase: str,
        tenant: str,
        region: str,
        gpu_s: float,
        prices: PriceTable,
        reason: str = "",
        recorded_at: dt.datetime | None = None,
    ) -> tuple[WastedAttempt, bool]:
        """`record_wasted`, and whether this call wrote the row."""
        price = prices.gpu_hour(region)
        stmt = (
            self._insert(WastedAttempt)
            .values(
                job_id=job_id,
                attempt=attempt,
                phase=phase,
                tenant=tenant,
                region=region,
                recorded_at=utc_naive(recorded_at),
                gpu_s=gpu_s,
                usd_per_gpu_h=price,
                cost_usd=gpu_usd(gpu_s, price),
                reason=reason,
            )
            .on_conflict_do_nothing(index_elements=["job_id", "attempt", "phase"])
        )
        with self.session() as s:
            inserted = s.execute(stmt).rowcount == 1  # type: ignore[attr-defined]
            row = s.scalars(
                select(WastedAttempt).where(
                    WastedAttempt.job_id == job_id, WastedAttempt.attempt == attempt, WastedAttempt.phase == phase
                )
            ).one()
        return row, inserted

    def entry(self, job_id: str) -> UsageEntry | None:
        with self.session() as s:
            return s.scalars(select(UsageEntry).where(UsageEntry.job_id == job_id)).one_or_none()

    def billed(self, job_ids: Sequence[str]) -> set[str]:
        """Which of `job_ids` have an entry: one query per `IN_CHUNK` ids."""
        return {row[0] for row in self._rows_of(select(UsageEntry.job_id), UsageEntry.job_id, job_ids)}

    def wasted_recorded(self, job_ids: Sequence[str]) -> set[tuple[str, int, str]]:
        """The (job id, attempt, phase) of the wasted attempts recorded for `job_ids`: one query per `IN_CHUNK`."""
        w = WastedAttempt
        rows = self._rows_of(select(w.job_id, w.attempt, w.phase), w.job_id, job_ids)
        return {(job_id, attempt, phase) for job_id, attempt, phase in rows}

    def _rows_of(self, query: Any, column: Any, job_ids: Sequence[str]) -> list[Any]:
        if not job_ids:
            return []
        with self.session() as s:
            return [
                row
                for i in range(0, len(job_ids), IN_CHUNK)
                for row in s.execute(query.where(column.in_(list(job_ids[i : i + IN_CHUNK]))))
            ]

    def wasted(self, job_id: str) -> list[WastedAttempt]:
        with self.session() as s:
            q = select(WastedAttempt).where(WastedAttempt.job_id == job_id)
            return list(s.scalars(q.order_by(WastedAttempt.attempt, WastedAttempt.phase)))

    def platform_cost(self, start: dt.datetime, end: dt.datetime) -> float:
        """Wasted attempts' $ in [start, end), all tenants."""
        q = select(func.coalesce(func.sum(WastedAttempt.cost_usd), 0.0)).where(
            WastedAttempt.recorded_at >= utc_naive(start), WastedAttempt.recorded_at < utc_naive(end)
        )
        with self.session() as s:
            return float(s.execute(q).scalar_one())

    def entries(
        self, tenant: str | None, start: dt.datetime, end: dt.datetime, limit: int = 10_000
    ) -> list[UsageEntry]:
        """Entries with `finished_at` in [start, end), newest first; `tenant` None: every tenant."""
        u = UsageEntry
        q = select(u).where(*self._window(tenant, start, end)).order_by(u.finished_at.desc(), u.id.desc())
        with self.session() as s:
            return list(s.scalars(q.limit(limit)))

    def spend(self, tenant: str, start: dt.datetime, end: dt.datetime) -> float:
        """The tenant's billed $ over [start, end) (what budgets are checked against)."""
        q = select(func.coalesce(func.sum(UsageEntry.total_usd), 0.0)).where(*self._window(tenant, start, end))
        with self.session() as s:
            return float(s.execute(q).scalar_one())

    @staticmethod
    def _window(tenant: str | None, start: dt.datetime, end: dt.datetime) -> tuple[Any, ...]:
        u = UsageEntry
        window = (u.finished_at >= utc_naive(start), u.finished_at < utc_naive(end))
        return window if tenant is None else (u.tenant == tenant, *window)

    def totals(self, tenant: str | None, start: dt.datetime, end: dt.datetime, group_by: GroupBy) -> list[GroupTotal]:
        """Usage with `finished_at` in [start, end) of `tenant` (None: all tenants), grouped by UTC day, model,
        tenant, region or phase (billing/queries.py says how each grouping counts)."""
        with self.session() as s:
            return queries.totals(s, self._window(tenant, start, end), group_by)

    def percentiles(
        self, tenant: str | None, start: dt.datetime, end: dt.datetime, column: str, qs: tuple[float, ...]
    ) -> dict[float, Any]:
        """Nearest-rank percentiles of `column` (`ttft_s`, `tpot_s`) over [start, end) of every entry that has
        one (queries.py `percentiles`)."""
        with self.session() as s:
            return queries.percentiles(s, self._window(tenant, start, end), column, qs)

    def link_bytes(self, start: dt.datetime, end: dt.datetime) -> dict[tuple[str, str], int]:
        """KV bytes on the wire per (prefill region, decode region) of split jobs finished in [start, end)."""
        with self.session() as s:
            return queries.link_bytes(s, self._window(None, start, end))
