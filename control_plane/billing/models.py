"""The ledger's tables (SQLAlchemy 2.x declarative): `UsageEntry`, the bill of one job, and `WastedAttempt`,
GPU time an attempt burned without producing the answer. The schema itself is made by the Alembic migrations
(`db/migrations`); `tests/control_plane/billing/test_ledger.py` checks these models match them.

Every column is NOT NULL unless its annotation says `| None`; the `Mapped[...]` annotation gives its type
(`float` -> FLOAT, `int` -> INTEGER, `BigInt` -> BIGINT, `StrN` -> VARCHAR(N)). Money in $, GPU time in
GPU-seconds, prices in $/GPU-hour and $/GB, bytes as counted."""

from __future__ import annotations

import datetime as dt

from sqlalchemy import UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column

from prfaas.control_plane.db.base import Base, BigInt, Str16, Str64, Str128, Str256, Str512


class UsageEntry(Base):
    """The bill of one job: the work that produced its answer, the prices it was billed at and the $ they
    give (billing/costs.py: `entry_values`)."""

    __tablename__ = "ledger_usage"
    __table_args__ = (UniqueConstraint("job_id", name="uq_ledger_usage_job_id"),)

    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    job_id: Mapped[Str64]
    tenant: Mapped[Str128] = mapped_column(index=True)
    model: Mapped[Str256]
    prefill_region: Mapped[Str128]
    decode_region: Mapped[Str128]
    finished_at: Mapped[dt.datetime] = mapped_column(index=True)  # UTC, naive
    # the work and the prices given with it
    prefill_gpu_s: Mapped[float]
    decode_gpu_s: Mapped[float]
    colocated_prefill_gpu_s: Mapped[float]  # had it prefilled in its decode region
    prefill_usd_per_gpu_h: Mapped[float]
    decode_usd_per_gpu_h: Mapped[float]
    egress_usd_per_gb: Mapped[float]
    tokens_in: Mapped[BigInt]
    tokens_out: Mapped[BigInt]
    kv_bytes_raw: Mapped[BigInt]
    kv_bytes_wire: Mapped[BigInt]
    # the $ computed from them
    prefill_usd: Mapped[float]
    decode_usd: Mapped[float]
    egress_usd: Mapped[float]
    total_usd: Mapped[float]
    colocated_usd: Mapped[float]
    savings_usd: Mapped[float]
    # 0002: how the answer was produced and how fast (the dashboard's placement and percentiles)
    placement: Mapped[Str16] = mapped_column(server_default="")
    attempts: Mapped[int] = mapped_column(server_default="1")
    ttft_s: Mapped[float | None]
    tpot_s: Mapped[float | None]
    # 0005: the KV codec its shipment crossed in ("" when local): lossy only with the tenant's consent
    codec: Mapped[Str16] = mapped_column(server_default="")


class WastedAttempt(Base):
    """GPU time an attempt burned without producing the answer (a failover, a lost region): the platform's
    cost, never the tenant's. Many per job; one per (job, attempt, phase)."""

    __tablename__ = "ledger_wasted"
    __table_args__ = (UniqueConstraint("job_id", "attempt", "phase", name="uq_ledger_wasted_attempt"),)

    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    job_id: Mapped[Str64] = mapped_column(index=True)
    attempt: Mapped[int]
    phase: Mapped[Str16]  # "prefill", "decode" or "local"
    tenant: Mapped[Str128]
    region: Mapped[Str128]
    recorded_at: Mapped[dt.datetime] = mapped_column(index=True)  # UTC, naive
    gpu_s: Mapped[float]
    usd_per_gpu_h: Mapped[float]
    cost_usd: Mapped[float]
    reason: Mapped[Str512] = mapped_column(default="")
