"""What the dashboard pages show, assembled from the ledger, the registry and the price book (no HTTP here).
Money in $, bytes as GB (10^9), times in ms; days are UTC."""

from __future__ import annotations

import datetime as dt
import time
from typing import Any

from prfaas.control_plane.billing.meter import Meter
from prfaas.control_plane.billing.models import UsageEntry
from prfaas.control_plane.billing.prices import quote_dict
from prfaas.control_plane.billing.spend import month_window

WINDOW = dt.timedelta(days=30)
RECENT_JOBS = 20
QUANTILES = (50, 90, 99)


def _days(start: dt.datetime, end: dt.datetime) -> list[str]:
    days, d = [], start.date()
    while d <= end.date():
        days.append(d.isoformat())
        d += dt.timedelta(days=1)
    return days


def tenant_view(meter: Meter, tenant: str, now: float | None = None) -> dict[str, Any]:
    """The last 30 days to `now` (epoch s; None: now), exactly: its figures, recent jobs and day charts (whose
    first day is the part of it in the window); "this month" is the calendar month of `now`. Every figure is
    summed in SQL over the whole window (a tenant's 30 days may hold millions of jobs); only the recent jobs'
    rows leave the database."""
    t = time.time() if now is None else now
    end = dt.datetime.fromtimestamp(t, dt.UTC) + dt.timedelta(seconds=1)  # a job finished at `now` is in
    start = end - WINDOW
    ledger = meter.ledger
    by_day = {g.key: g for g in ledger.totals(tenant, start, end, "day")}
    by_region = {g.key: g.total_usd for g in ledger.totals(tenant, start, end, "region")}
    days = _days(start, end)
    phases = ("prefill", "decode", "egress")

    def daily(field: str) -> list[float]:
        return [round(getattr(by_day[d], field), 9) if d in by_day else 0.0 for d in days]

    def summed(field: str) -> Any:
        return sum(getattr(g, field) for g in by_day.values())

    charts = {
        "spend_phase": {"labels": days, "datasets": [{"label": p, "data": daily(f"{p}_usd")} for p in phases]},
        "spend_region": {
            "labels": sorted(by_region),
            "datasets": [{"label": "$", "data": [round(by_region[r], 9) for r in sorted(by_region)]}],
        },
        "savings": {
            "labels": days,
            "datasets": [
                {"label": "billed", "data": daily("total_usd")},
                {"label": "colocated", "data": daily("colocated_usd")},
            ],
        },
    }  # fmt: skip
    total, colo = summed("total_usd"), summed("colocated_usd")
    ttft = ledger.percentiles(tenant, start, end, "ttft_s", QUANTILES)
    tpot = ledger.percentiles(tenant, start, end, "tpot_s", QUANTILES)
    return {
        "start": start,
        "end": end,
        "jobs": summed("jobs"),
        "spend_usd": total,
        "colocated_usd": colo,
        "savings_usd": colo - total,
        "savings_pct": (colo - total) / colo * 100 if colo else 0.0,
        "tokens_in": summed("tokens_in"),
        "tokens_out": summed("tokens_out"),
        "gb_raw": summed("kv_bytes_raw") / 1e9,
        "gb_wire": summed("kv_bytes_wire") / 1e9,
        "ttft_ms": {q: None if v is None else v * 1000 for q, v in ttft.items()},
        "tpot_ms": {q: None if v is None else v * 1000 for q, v in tpot.items()},
        "recent": [_job_row(e) for e in ledger.entries(tenant, start, end, limit=RECENT_JOBS)],
        "month_spend_usd": ledger.spend(tenant, *month_window(t)),
        "charts": charts,
    }


def _job_row(e: UsageEntry) -> dict[str, Any]:
    return {
        "job_id": e.job_id, "finished_at": e.finished_at.strftime("%Y-%m-%d %H:%M:%S"), "placement": e.placement,
        "route": e.decode_region if e.prefill_region == e.decode_region else f"{e.prefill_region} → {e.decode_region}",
        "attempts": e.attempts, "tokens_in": e.tokens_in, "tokens_out": e.tokens_out,
        "mb_wire": e.kv_bytes_wire / 1e6, "ttft_ms": None if e.ttft_s is None else e.ttft_s * 1000,
        "total_usd": e.total_usd, "savings_usd": round(e.savings_usd, 9) + 0.0,  # no "-0.000000"
    }  # fmt: skip


def admin_view(meter: Meter, now: float | None = None) -> dict[str, Any]:
    s = meter.s
    t = time.time() if now is None else now
    end = dt.datetime.fromtimestamp(t, dt.UTC) + dt.timedelta(seconds=1)
    hour_ago = end - dt.timedelta(hours=1)
    regions: list[dict[str, Any]] = []
    for r in s.regions.regions():
        od = meter.prices.quote(r.name, "on-demand")
        regions.append({
            "name": r.name, "role": r.role, "gpu_type": r.gpu_type, "alive": r.alive, "healthy": r.healthy,
            "utilization_pct": min(r.busy_workers, r.num_workers) / max(1, r.num_workers) * 100,
            "busy": r.busy_workers, "workers": r.num_workers, "queue_depth": r.queue_depth,
            "kv_used_gb": r.kv_used_bytes / 1e9, "kv_free_gb": r.kv_free_bytes / 1e9,
            "price": od.usd_per_gpu_hour if od else r.usd_per_gpu_hour, "price_source": od.source if od else "region",
        })  # fmt: skip
    shipped = meter.ledger.link_bytes(hour_ago, end)
    links = []
    redis_now = s.regions.clock()  # the estimates' clock (Redis's), whatever `now` the view is of
    estimates = s.regions.link_estimates(redis_now)
    for link in s.regions.configured_links():
        wire = shipped.get((link.src, link.dst), 0)
        gbps = wire * 8 / 3600 / 1e9  # mean over the last hour
        measured = estimates.get((link.src, link.dst))
        links.append({
            "src": link.src, "dst": link.dst, "rtt_ms": link.rtt_ms, "bandwidth_gbps": link.bandwidth_gbps,
            "egress_usd_per_gb": link.egress_usd_per_gb, "gb_last_hour": wire / 1e9, "mean_gbps": gbps,
            "utilization_pct": gbps / link.bandwidth_gbps * 100 if link.bandwidth_gbps else 0.0,
            "measured_gbps": measured.measured_gbps if measured else None,
            "measured_rtt_ms": measured.min_rtt_ms if measured else None,
            "measured_age_s": measured.age_s(redis_now) if measured else None,
        })  # fmt: skip
    month = month_window(t)
    names = {x.id: x.name for x in s.tenants.all()}  # every tenant ever (the database never deletes one)
    tenants: list[dict[str, Any]] = [
        {"id": g.key, "name": names.get(g.key, g.key), "jobs": g.jobs, "spend_usd": g.total_usd,
         "savings_usd": g.savings_usd}
        for g in meter.ledger.totals(None, month[0], month[1], "tenant")
    ]  # fmt: skip
    return {
        "regions": regions,
        "links": links,
        "prices": [quote_dict(q) for q in meter.prices.quotes()],
        "tenants": tenants,
        "platform_cost_usd": meter.ledger.platform_cost(*month),
        "charts": {
            "tenant_spend": {
                "labels": [x["name"] for x in tenants],
                "datasets": [{"label": "$ this month", "data": [round(x["spend_usd"], 9) for x in tenants]}],
            },
            "region_util": {
                "labels": [r["name"] for r in regions],
                "datasets": [{"label": "% busy", "data": [round(r["utilization_pct"], 2) for r in regions]}],
            },
        },
    }
