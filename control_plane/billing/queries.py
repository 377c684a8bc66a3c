"""Reporting over the ledger: usage totals in a time window grouped by UTC day, model, tenant, region or phase
(`GroupTotal` rows; what `/v1/usage`, `/admin/usage` and the dashboard show). Read-only queries on a session.

By region, a job's prefill $, egress $ and tokens in count for its prefill region, its decode $, colocated $
and tokens out for its decode region; a job counts once in each region it touched. By phase: `prefill`,
`decode` and `egress` rows, each with that phase's $ as its total (and its colocated $: colocated prefill /
decode GPU-s at the decode region's price; 0 for egress)."""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict
from sqlalchemy import case, func, select
from sqlalchemy.orm import Session

from prfaas.control_plane.billing.models import UsageEntry

GroupBy = Literal["day", "region", "model", "phase", "tenant"]
GROUP_BYS: tuple[str, ...] = ("day", "region", "phase", "model", "tenant")
PHASES = ("prefill", "decode", "egress")


class GroupTotal(BaseModel):
    """One group's sums: $ by phase and in all, what colocated would have cost, tokens, bytes, GPU-seconds.
    The API's `UsageRow` is this model, field for field."""

    model_config = ConfigDict(frozen=True)

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


SUMMED = tuple(GroupTotal.model_fields)[2:]  # every field past key and jobs is a column's sum


_CASTS: dict[str, Any] = {name: f.annotation for name, f in GroupTotal.model_fields.items() if f.annotation}


def _typed(values: dict[str, Any]) -> GroupTotal:
    """A GroupTotal from raw sums (PostgreSQL sums integers as NUMERIC: cast each to its field's type)."""
    return GroupTotal(**{name: _CASTS[name](value) for name, value in values.items()})


def totals(session: Session, window: tuple[Any, ...], group_by: GroupBy) -> list[GroupTotal]:
    """Usage of the entries matching `window` (SQL conditions) grouped by `group_by`."""
    if group_by == "region":
        return _region_totals(session, window)
    if group_by == "phase":
        return _phase_totals(session, window)
    u = UsageEntry
    key: Any = {"day": func.date(u.finished_at), "model": u.model, "tenant": u.tenant}[group_by]
    q = select(key, func.count(), *(func.sum(getattr(u, name)) for name in SUMMED))
    rows = session.execute(q.where(*window).group_by(key).order_by(key)).all()
    out = []
    for key_value, jobs, *sums in rows:
        shown = str(key_value)[:10] if group_by == "day" else str(key_value)  # a day: YYYY-MM-DD
        out.append(_typed({"key": shown, "jobs": jobs} | dict(zip(SUMMED, sums, strict=True))))
    return out


def _phase_totals(session: Session, window: tuple[Any, ...]) -> list[GroupTotal]:
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
    n, p, d, e, colo_p, colo_d, t_in, t_out, raw, wire, p_s, d_s, shipped = tuple(session.execute(q).one())
    if not n:
        return []
    zero = dict.fromkeys(SUMMED, 0.0)
    rows = {
        "prefill": (n, float(p), float(colo_p), {"prefill_usd": p, "tokens_in": t_in, "prefill_gpu_s": p_s}),
        "decode": (n, float(d), float(colo_d), {"decode_usd": d, "tokens_out": t_out, "decode_gpu_s": d_s}),
        "egress": (shipped, float(e), 0.0, {"egress_usd": e, "kv_bytes_raw": raw, "kv_bytes_wire": wire}),
    }
    out = []
    for phase in PHASES:
        jobs, usd, colo, sums = rows[phase]
        both = {"total_usd": usd, "colocated_usd": colo, "savings_usd": colo - usd}
        out.append(_typed({"key": phase, "jobs": jobs} | zero | sums | both))
    return out


def _region_totals(session: Session, window: tuple[Any, ...]) -> list[GroupTotal]:
    u = UsageEntry
    split = u.prefill_region != u.decode_region
    # Per prefill region: its jobs and their prefill-side sums; per decode region: its split jobs (a local job
    # was counted on the prefill side already: same region) and the decode-side sums.
    prefill_side = ("prefill_usd", "egress_usd", "tokens_in", "kv_bytes_raw", "kv_bytes_wire", "prefill_gpu_s")
    decode_side = ("decode_usd", "colocated_usd", "tokens_out", "decode_gpu_s")
    pq = select(u.prefill_region, func.count(), *(func.sum(getattr(u, name)) for name in prefill_side))
    dq = select(u.decode_region, func.sum(case((split, 1), else_=0)), *(func.sum(getattr(u, c)) for c in decode_side))
    acc: dict[str, dict[str, Any]] = {}
    for q, names in ((pq.group_by(u.prefill_region), prefill_side), (dq.group_by(u.decode_region), decode_side)):
        for region, jobs, *sums in session.execute(q.where(*window)).all():
            a = acc.setdefault(str(region), dict.fromkeys(SUMMED, 0.0) | {"jobs": 0})
            a["jobs"] += jobs  # NUMERIC on PostgreSQL: `_typed` makes it an int
            a.update(zip(names, sums, strict=True))
    out = []
    for region in sorted(acc):
        a = acc[region]
        a["total_usd"] = float(a["prefill_usd"]) + float(a["decode_usd"]) + float(a["egress_usd"])
        a["savings_usd"] = float(a["colocated_usd"]) - a["total_usd"]
        out.append(_typed({"key": region} | a))
    return out


def percentiles(session: Session, window: tuple[Any, ...], column: str, qs: tuple[float, ...]) -> dict[float, Any]:
    """Nearest-rank percentiles (q in [0, 100]) of `column` over the entries matching `window` that have a
    value: a count, then per q the value at its rank (an ordered scan of the window's rows, by the tenant and
    finished_at indexes; no index orders `column`); None for each q when none has one. Portable (SQLite has
    no percentile_disc), and no row leaves the database but the answers."""
    value = getattr(UsageEntry, column)
    where = (*window, value.is_not(None))
    n = session.execute(select(func.count()).where(*where)).scalar_one()
    out: dict[float, Any] = {}
    for q in qs:
        rank = max(1, math.ceil(q / 100 * n))
        out[q] = session.execute(select(value).where(*where).order_by(value).offset(rank - 1).limit(1)).scalar()
    return out


def link_bytes(session: Session, window: tuple[Any, ...]) -> dict[tuple[str, str], int]:
    """KV bytes on the wire per (prefill region, decode region) of the split entries matching `window`."""
    u = UsageEntry
    q = select(u.prefill_region, u.decode_region, func.sum(u.kv_bytes_wire)).where(
        *window, u.prefill_region != u.decode_region
    )
    rows = session.execute(q.group_by(u.prefill_region, u.decode_region)).all()
    return {(str(src), str(dst)): int(total or 0) for src, dst, total in rows}
