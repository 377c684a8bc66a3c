"""The usage ledger (issue 8, core): one billed entry per job, written exactly once, and wasted attempts
recorded separately as the platform's cost. SQLAlchemy 2.x; SQLite embedded by default, PostgreSQL by URL;
the schema is brought to head by Alembic (`control_plane/migrations`) when a `Ledger` starts.

Costs are computed here, from GPU-seconds and the prices given with the entry, and the prices are stored
beside them so any sum can be recomputed: prefill $ = prefill GPU-s / 3600 x prefill region $/GPU-h,
decode $ likewise, egress $ = wire bytes / 1e9 x the (prefill -> decode) link's $/GB (0 when colocated),
colocated $ = (colocated prefill GPU-s + decode GPU-s) / 3600 x decode region $/GPU-h."""

from __future__ import annotations

import datetime as dt
import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict
from sqlalchemy import (
    BigInteger,
    DateTime,
    Float,
    Integer,
    String,
    UniqueConstraint,
    case,
    create_engine,
    event,
    func,
    select,
)
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import Engine
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker

GroupBy = Literal["day", "region", "model", "phase", "tenant"]
GROUP_BYS: tuple[str, ...] = ("day", "region", "phase", "model", "tenant")
PHASES = ("prefill", "decode", "egress")


def default_ledger_url() -> str:
    home = Path(os.environ.get("PRFAAS_HOME") or Path.home() / ".cache" / "prfaas").expanduser()
    return f"sqlite:///{home / 'ledger.db'}"


class LedgerSettings(BaseSettings):
    """`PRFAAS_LEDGER_URL`: where the ledger lives (default `sqlite:///$PRFAAS_HOME/ledger.db`)."""

    model_config = SettingsConfigDict(env_prefix="PRFAAS_", extra="ignore", frozen=True)

    ledger_url: str = Field(default_factory=default_ledger_url, description="SQLAlchemy URL of the usage ledger")


class Base(DeclarativeBase):
    pass


class UsageEntry(Base):
    """The bill of one job: the work that produced its answer."""

    __tablename__ = "ledger_usage"
    __table_args__ = (UniqueConstraint("job_id", name="uq_ledger_usage_job_id"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(String(64), nullable=False)
    tenant: Mapped[str] = mapped_column(String(128), nullable=False, index=True)
    model: Mapped[str] = mapped_column(String(256), nullable=False)
    prefill_region: Mapped[str] = mapped_column(String(128), nullable=False)
    decode_region: Mapped[str] = mapped_column(String(128), nullable=False)
    finished_at: Mapped[dt.datetime] = mapped_column(DateTime(), nullable=False, index=True)
    prefill_gpu_s: Mapped[float] = mapped_column(Float, nullable=False)
    decode_gpu_s: Mapped[float] = mapped_column(Float, nullable=False)
    colocated_prefill_gpu_s: Mapped[float] = mapped_column(Float, nullable=False)
    prefill_usd_per_gpu_h: Mapped[float] = mapped_column(Float, nullable=False)
    decode_usd_per_gpu_h: Mapped[float] = mapped_column(Float, nullable=False)
    egress_usd_per_gb: Mapped[float] = mapped_column(Float, nullable=False)
    tokens_in: Mapped[int] = mapped_column(BigInteger, nullable=False)
    tokens_out: Mapped[int] = mapped_column(BigInteger, nullable=False)
    kv_bytes_raw: Mapped[int] = mapped_column(BigInteger, nullable=False)
    kv_bytes_wire: Mapped[int] = mapped_column(BigInteger, nullable=False)
    prefill_usd: Mapped[float] = mapped_column(Float, nullable=False)
    decode_usd: Mapped[float] = mapped_column(Float, nullable=False)
    egress_usd: Mapped[float] = mapped_column(Float, nullable=False)
    total_usd: Mapped[float] = mapped_column(Float, nullable=False)
    colocated_usd: Mapped[float] = mapped_column(Float, nullable=False)
    savings_usd: Mapped[float] = mapped_column(Float, nullable=False)
    # 0002: how the answer was produced and how fast (the dashboard's placement and percentiles)
    placement: Mapped[str] = mapped_column(String(16), nullable=False, server_default="")
    attempts: Mapped[int] = mapped_column(Integer, nullable=False, server_default="1")
    ttft_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    tpot_s: Mapped[float | None] = mapped_column(Float, nullable=True)


class WastedAttempt(Base):
    """GPU time an attempt burned without producing the answer (a failover, a lost region): the platform's
    cost, never the tenant's. Many per job; one per (job, attempt, phase)."""

    __tablename__ = "ledger_wasted"
    __table_args__ = (UniqueConstraint("job_id", "attempt", "phase", name="uq_ledger_wasted_attempt"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(String(64), nullable=False, index=True)
    attempt: Mapped[int] = mapped_column(Integer, nullable=False)
    phase: Mapped[str] = mapped_column(String(16), nullable=False)
    tenant: Mapped[str] = mapped_column(String(128), nullable=False)
    region: Mapped[str] = mapped_column(String(128), nullable=False)
    recorded_at: Mapped[dt.datetime] = mapped_column(DateTime(), nullable=False, index=True)
    gpu_s: Mapped[float] = mapped_column(Float, nullable=False)
    usd_per_gpu_h: Mapped[float] = mapped_column(Float, nullable=False)
    cost_usd: Mapped[float] = mapped_column(Float, nullable=False)
    reason: Mapped[str] = mapped_column(String(512), nullable=False, default="")


@dataclass(frozen=True)
class PriceTable:
    """$/GPU-hour per region and $/GB per directed (src, dst) link; what a job is billed at."""

    gpu_hour_usd: Mapping[str, float]
    egress_usd_per_gb: Mapping[tuple[str, str], float] = field(default_factory=dict)

    def gpu_hour(self, region: str) -> float:
        try:
            return float(self.gpu_hour_usd[region])
        except KeyError:
            raise KeyError(f"no $/GPU-hour for region {region!r}") from None

    def egress(self, src: str, dst: str) -> float:
        if src == dst:
            return 0.0
        try:
            return float(self.egress_usd_per_gb[(src, dst)])
        except KeyError:
            raise KeyError(f"no egress $/GB for link {src!r} -> {dst!r}") from None


@dataclass(frozen=True)
class JobUsage:
    """What the control plane knows of a finished job (from its record in the job store)."""

    job_id: str
    tenant: str
    model: str
    prefill_region: str
    decode_region: str
    prefill_gpu_s: float
    decode_gpu_s: float
    tokens_in: int
    tokens_out: int
    kv_bytes_raw: int = 0
    kv_bytes_wire: int = 0
    finished_at: dt.datetime | None = None
    colocated_prefill_gpu_s: float | None = None  # prefill GPU-s had it run in the decode region; None: same
    placement: str = ""  # "local" or "split"
    attempts: int = 1  # the attempt that answered
    ttft_s: float | None = None  # job created -> first token reached the control plane
    tpot_s: float | None = None  # mean s per output token after the first


@dataclass(frozen=True)
class GroupTotal:
    key: str
    jobs: int
    prefill_usd: float
    decode_usd: float
    egress_usd: float
    total_usd: float
    colocated_usd: float
    savings_usd: float
    tokens_in: int
    tokens_out: int
    kv_bytes_raw: int
    kv_bytes_wire: int
    prefill_gpu_s: float = 0.0
    decode_gpu_s: float = 0.0


def _utc_naive(t: dt.datetime | None) -> dt.datetime:
    if t is None:
        return dt.datetime.now(dt.UTC).replace(tzinfo=None)
    if t.tzinfo is not None:
        t = t.astimezone(dt.UTC).replace(tzinfo=None)
    return t


def _entry_values(usage: JobUsage, prices: PriceTable) -> dict[str, Any]:
    """The ledger row of a job: its GPU-seconds and bytes, the prices given and the costs computed from them."""
    p_price = prices.gpu_hour(usage.prefill_region)
    d_price = prices.gpu_hour(usage.decode_region)
    e_price = prices.egress(usage.prefill_region, usage.decode_region)
    colo_prefill_s = usage.prefill_gpu_s if usage.colocated_prefill_gpu_s is None else usage.colocated_prefill_gpu_s
    prefill_usd = usage.prefill_gpu_s / 3600.0 * p_price
    decode_usd = usage.decode_gpu_s / 3600.0 * d_price
    egress_usd = usage.kv_bytes_wire / 1e9 * e_price
    total = prefill_usd + decode_usd + egress_usd
    colocated = (colo_prefill_s + usage.decode_gpu_s) / 3600.0 * d_price
    return {
        "job_id": usage.job_id,
        "tenant": usage.tenant,
        "model": usage.model,
        "prefill_region": usage.prefill_region,
        "decode_region": usage.decode_region,
        "finished_at": _utc_naive(usage.finished_at),
        "prefill_gpu_s": usage.prefill_gpu_s,
        "decode_gpu_s": usage.decode_gpu_s,
        "colocated_prefill_gpu_s": colo_prefill_s,
        "prefill_usd_per_gpu_h": p_price,
        "decode_usd_per_gpu_h": d_price,
        "egress_usd_per_gb": e_price,
        "tokens_in": usage.tokens_in,
        "tokens_out": usage.tokens_out,
        "kv_bytes_raw": usage.kv_bytes_raw,
        "kv_bytes_wire": usage.kv_bytes_wire,
        "prefill_usd": prefill_usd,
        "decode_usd": decode_usd,
        "egress_usd": egress_usd,
        "total_usd": total,
        "colocated_usd": colocated,
        "savings_usd": colocated - total,
        "placement": usage.placement,
        "attempts": usage.attempts,
        "ttft_s": usage.ttft_s,
        "tpot_s": usage.tpot_s,
    }


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
            raise ValueError("a ledger schema is only supported on PostgreSQL")

        @event.listens_for(engine, "connect")
        def _search_path(dbapi_conn: Any, _record: Any) -> None:
            cur = dbapi_conn.cursor()
            cur.execute(f'SET search_path TO "{schema}"')
            cur.close()
            dbapi_conn.commit()

    return engine


class Ledger:
    def __init__(self, url: str | None = None, *, schema: str | None = None, migrate: bool = True) -> None:
        from prfaas.control_plane.migrations import upgrade

        self.url = url or LedgerSettings().ledger_url
        self.engine = make_engine(self.url, schema)
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
            rows.setdefault(usage.job_id, _entry_values(usage, prices))
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
                recorded_at=_utc_naive(recorded_at),
                gpu_s=gpu_s,
                usd_per_gpu_h=price,
                cost_usd=gpu_s / 3600.0 * price,
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

    def wasted(self, job_id: str) -> list[WastedAttempt]:
        with self.session() as s:
            q = select(WastedAttempt).where(WastedAttempt.job_id == job_id)
            return list(s.scalars(q.order_by(WastedAttempt.attempt, WastedAttempt.phase)))

    def platform_cost(self, start: dt.datetime, end: dt.datetime) -> float:
        """Wasted attempts' $ in [start, end), all tenants."""
        q = select(func.coalesce(func.sum(WastedAttempt.cost_usd), 0.0)).where(
            WastedAttempt.recorded_at >= _utc_naive(start), WastedAttempt.recorded_at < _utc_naive(end)
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
        window = (u.finished_at >= _utc_naive(start), u.finished_at < _utc_naive(end))
        return window if tenant is None else (u.tenant == tenant, *window)

    def totals(self, tenant: str | None, start: dt.datetime, end: dt.datetime, group_by: GroupBy) -> list[GroupTotal]:
        """Usage with `finished_at` in [start, end) of `tenant` (None: all tenants), grouped by UTC day, model,
        tenant, region or phase. By region, a job's prefill $, egress $ and tokens in count for its prefill
        region, its decode $, colocated $ and tokens out for its decode region; a job counts once in each region
        it touched. By phase: `prefill`, `decode` and `egress` rows, each with that phase's $ as its total (and
        its colocated $: colocated prefill / decode GPU-s at the decode region's price; 0 for egress)."""
        window = self._window(tenant, start, end)
        if group_by == "region":
            return self._region_totals(window)
        if group_by == "phase":
            return self._phase_totals(window)
        u = UsageEntry
        key: Any = {"day": func.date(u.finished_at), "model": u.model, "tenant": u.tenant}[group_by]
        q = (
            select(
                key,
                func.count(),
                func.sum(u.prefill_usd),
                func.sum(u.decode_usd),
                func.sum(u.egress_usd),
                func.sum(u.total_usd),
                func.sum(u.colocated_usd),
                func.sum(u.savings_usd),
                func.sum(u.tokens_in),
                func.sum(u.tokens_out),
                func.sum(u.kv_bytes_raw),
                func.sum(u.kv_bytes_wire),
                func.sum(u.prefill_gpu_s),
                func.sum(u.decode_gpu_s),
            )
            .where(*window)
            .group_by(key)
            .order_by(key)
        )
        with self.session() as s:
            rows = s.execute(q).all()
        return [
            GroupTotal(
                key=str(r[0])[:10] if group_by == "day" else str(r[0]),
                jobs=int(r[1]),
                prefill_usd=float(r[2]),
                decode_usd=float(r[3]),
                egress_usd=float(r[4]),
                total_usd=float(r[5]),
                colocated_usd=float(r[6]),
                savings_usd=float(r[7]),
                tokens_in=int(r[8]),
                tokens_out=int(r[9]),
                kv_bytes_raw=int(r[10]),
                kv_bytes_wire=int(r[11]),
                prefill_gpu_s=float(r[12]),
                decode_gpu_s=float(r[13]),
            )
            for r in rows
        ]

    def _phase_totals(self, window: tuple[Any, ...]) -> list[GroupTotal]:
        u = UsageEntry
        q = select(
            func.count(),
            func.sum(u.prefill_usd),
            func.sum(u.decode_usd),
            func.sum(u.egress_usd),
            func.sum(u.colocated_prefill_gpu_s / 3600.0 * u.decode_usd_per_gpu_h),
            func.sum(u.decode_gpu_s / 3600.0 * u.decode_usd_per_gpu_h),
            func.sum(u.tokens_in),
            func.sum(u.tokens_out),
            func.sum(u.kv_bytes_raw),
            func.sum(u.kv_bytes_wire),
            func.sum(u.prefill_gpu_s),
            func.sum(u.decode_gpu_s),
            func.sum(case((u.kv_bytes_wire > 0, 1), else_=0)),
        ).where(*window)
        with self.session() as s:
            n, p, d, e, colo_p, colo_d, t_in, t_out, raw, wire, p_s, d_s, shipped = tuple(s.execute(q).one())
        if not n:
            return []
        zero = {"tokens_in": 0, "tokens_out": 0, "kv_bytes_raw": 0, "kv_bytes_wire": 0}
        rows = {
            "prefill": (int(n), float(p), float(colo_p), zero | {"tokens_in": int(t_in)}, float(p_s), 0.0),
            "decode": (int(n), float(d), float(colo_d), zero | {"tokens_out": int(t_out)}, 0.0, float(d_s)),
            "egress": (int(shipped), float(e), 0.0, zero | {"kv_bytes_raw": int(raw), "kv_bytes_wire": int(wire)},
                       0.0, 0.0),
        }  # fmt: skip
        out = []
        for phase in PHASES:
            jobs, usd, colo, counts, pg, dg = rows[phase]
            out.append(
                GroupTotal(
                    key=phase,
                    jobs=jobs,
                    prefill_usd=usd if phase == "prefill" else 0.0,
                    decode_usd=usd if phase == "decode" else 0.0,
                    egress_usd=usd if phase == "egress" else 0.0,
                    total_usd=usd,
                    colocated_usd=colo,
                    savings_usd=colo - usd,
                    prefill_gpu_s=pg,
                    decode_gpu_s=dg,
                    **counts,
                )
            )
        return out

    def _region_totals(self, window: tuple[Any, ...]) -> list[GroupTotal]:
        u = UsageEntry
        split = u.prefill_region != u.decode_region
        pq = (
            select(
                u.prefill_region,
                func.count(),
                func.sum(u.prefill_usd),
                func.sum(u.egress_usd),
                func.sum(u.tokens_in),
                func.sum(u.kv_bytes_raw),
                func.sum(u.kv_bytes_wire),
                func.sum(u.prefill_gpu_s),
            )
            .where(*window)
            .group_by(u.prefill_region)
        )
        dq = (
            select(
                u.decode_region,
                func.sum(case((split, 1), else_=0)),
                func.sum(u.decode_usd),
                func.sum(u.colocated_usd),
                func.sum(u.tokens_out),
                func.sum(u.decode_gpu_s),
            )
            .where(*window)
            .group_by(u.decode_region)
        )
        acc: dict[str, dict[str, float]] = {}
        with self.session() as s:
            for p in s.execute(pq).all():
                a = acc.setdefault(str(p[0]), {})
                a.update(jobs=int(p[1]), prefill=float(p[2]), egress=float(p[3]), t_in=int(p[4]))
                a.update(raw=int(p[5]), wire=int(p[6]), p_s=float(p[7]))
            for d in s.execute(dq).all():
                a = acc.setdefault(str(d[0]), {})
                a["jobs"] = a.get("jobs", 0) + int(d[1])
                a.update(decode=float(d[2]), colo=float(d[3]), t_out=int(d[4]), d_s=float(d[5]))
        out = []
        for region in sorted(acc):
            a = acc[region]
            total = a.get("prefill", 0.0) + a.get("decode", 0.0) + a.get("egress", 0.0)
            colo = a.get("colo", 0.0)
            out.append(
                GroupTotal(
                    key=region,
                    jobs=int(a.get("jobs", 0)),
                    prefill_usd=a.get("prefill", 0.0),
                    decode_usd=a.get("decode", 0.0),
                    egress_usd=a.get("egress", 0.0),
                    total_usd=total,
                    colocated_usd=colo,
                    savings_usd=colo - total,
                    tokens_in=int(a.get("t_in", 0)),
                    tokens_out=int(a.get("t_out", 0)),
                    kv_bytes_raw=int(a.get("raw", 0)),
                    kv_bytes_wire=int(a.get("wire", 0)),
                    prefill_gpu_s=a.get("p_s", 0.0),
                    decode_gpu_s=a.get("d_s", 0.0),
                )
            )
        return out
