"""What the dashboard pages compute (control_plane/dashboard/data.py), without a browser: figures summed over
the whole window however many jobs it holds, on SQLite and PostgreSQL."""

from __future__ import annotations

import datetime as dt
import math
import random
import types

from prfaas.control_plane.billing.costs import JobUsage, PriceTable
from prfaas.control_plane.billing.ledger import Ledger
from prfaas.control_plane.dashboard.data import RECENT_JOBS, tenant_view

PRICES = PriceTable({"cheap": 1.2, "dear": 4.0}, {("cheap", "dear"): 0.09})
NOW = dt.datetime(2026, 11, 30, 12, 0, tzinfo=dt.UTC)


def _nearest_rank(values: list[float], q: float) -> float | None:
    ordered = sorted(values)
    return ordered[max(1, math.ceil(q / 100 * len(ordered))) - 1] if ordered else None


def test_tenant_view_sums_every_job_of_the_window_beyond_ten_thousand(ledger: Ledger) -> None:
    # 10,050 jobs over 10 days (more than the 10,000 rows a ledger read returns at most), some split (egress,
    # KV bytes), some without a TPOT (one token), and one of another tenant and one older than the window.
    rng = random.Random(7)
    jobs = []
    for i in range(10_050):
        split = i % 3 == 0
        jobs.append(JobUsage(
            f"j{i}", "acme", "m", "cheap" if split else "dear", "dear", rng.uniform(0.1, 2), rng.uniform(0.1, 2),
            100 + i % 50, 5 + i % 7, kv_bytes_raw=2_000_000 if split else 0, kv_bytes_wire=1_000_000 if split else 0,
            finished_at=NOW - dt.timedelta(days=10) + dt.timedelta(seconds=85 * i), ttft_s=rng.uniform(0.05, 3),
            tpot_s=None if i % 10 == 0 else rng.uniform(0.01, 0.1), placement="split" if split else "local",
        ))  # fmt: skip
    jobs.append(JobUsage("other", "globex", "m", "dear", "dear", 9, 9, 9, 9, finished_at=NOW))
    jobs.append(JobUsage("old", "acme", "m", "dear", "dear", 9, 9, 9, 9, finished_at=NOW - dt.timedelta(days=40)))
    for k in range(0, len(jobs), 2000):
        ledger.record_many([(job, PRICES) for job in jobs[k : k + 2000]])
    entries = ledger.entries("acme", NOW - dt.timedelta(days=11), NOW, limit=20_000)
    assert len(entries) == 10_050

    view = tenant_view(types.SimpleNamespace(ledger=ledger), "acme", NOW.timestamp())

    assert view["jobs"] == 10_050
    assert math.isclose(view["spend_usd"], sum(e.total_usd for e in entries), rel_tol=1e-9)
    assert math.isclose(view["colocated_usd"], sum(e.colocated_usd for e in entries), rel_tol=1e-9)
    assert view["tokens_in"] == sum(e.tokens_in for e in entries)
    assert view["tokens_out"] == sum(e.tokens_out for e in entries)
    assert math.isclose(view["gb_wire"], sum(e.kv_bytes_wire for e in entries) / 1e9)
    for q in (50, 90, 99):  # nearest rank over every job that has one
        assert math.isclose(view["ttft_ms"][q], _nearest_rank([e.ttft_s * 1000 for e in entries], q))
        expected_tpot = _nearest_rank([e.tpot_s * 1000 for e in entries if e.tpot_s is not None], q)
        assert math.isclose(view["tpot_ms"][q], expected_tpot)
    phases = {d["label"]: d["data"] for d in view["charts"]["spend_phase"]["datasets"]}
    first_day = (NOW - dt.timedelta(days=10)).date().isoformat()  # the oldest day: past the newest 10,000
    day = view["charts"]["spend_phase"]["labels"].index(first_day)
    expected = sum(e.prefill_usd for e in entries if e.finished_at.date().isoformat() == first_day)
    assert expected > 0 and math.isclose(phases["prefill"][day], expected, rel_tol=1e-6)
    chart = view["charts"]["spend_region"]
    regions = dict(zip(chart["labels"], chart["datasets"][0]["data"], strict=True))
    cheap = sum(e.prefill_usd + e.egress_usd for e in entries if e.prefill_region == "cheap")
    assert math.isclose(regions["cheap"], cheap, rel_tol=1e-6)
    assert [r["job_id"] for r in view["recent"]] == [f"j{i}" for i in range(10_049, 10_049 - RECENT_JOBS, -1)]
    start, end = view["start"], view["end"]
    assert ledger.link_bytes(start, end) == {("cheap", "dear"): sum(e.kv_bytes_wire for e in entries)}


def test_tenant_view_of_a_tenant_without_jobs(ledger: Ledger) -> None:
    view = tenant_view(types.SimpleNamespace(ledger=ledger), "nobody", NOW.timestamp())
    assert view["jobs"] == 0 and view["spend_usd"] == 0 and view["recent"] == []
    assert view["ttft_ms"] == {50: None, 90: None, 99: None} and view["savings_pct"] == 0.0
    chart = view["charts"]["spend_phase"]
    assert len(chart["labels"]) == 31 and set(chart["datasets"][0]["data"]) == {0.0}


def test_tenant_view_is_the_last_30_days_to_the_second_and_its_month_is_the_views(ledger: Ledger) -> None:
    """Not from the midnight before them (up to 31 days), and "this month" is the month of the view's `now`,
    not of the wall clock."""
    now = dt.datetime(2026, 11, 30, 23, 0, tzinfo=dt.UTC)  # the window: from 2026-10-31 23:00:01
    finished = {
        "before": now - dt.timedelta(days=30, hours=22),  # 2026-10-31 01:00: that day, but not the last 30 days
        "october": now - dt.timedelta(days=29, hours=23, minutes=30),  # 2026-10-31 23:30: in them, not this month
        "november": now - dt.timedelta(hours=1),
    }
    ledger.record_many([(JobUsage(job_id, "acme", "m", "dear", "dear", 1, 1, 10, 2, finished_at=at), PRICES)
                        for job_id, at in finished.items()])  # fmt: skip
    usd = {e.job_id: e.total_usd for e in ledger.entries("acme", now - dt.timedelta(days=40), now, limit=10)}

    view = tenant_view(types.SimpleNamespace(ledger=ledger), "acme", now.timestamp())

    assert view["end"] - view["start"] == dt.timedelta(days=30)
    assert view["jobs"] == 2 and view["tokens_in"] == 20
    assert [r["job_id"] for r in view["recent"]] == ["november", "october"]
    assert math.isclose(view["spend_usd"], usd["october"] + usd["november"], rel_tol=1e-9)
    chart = view["charts"]["savings"]
    billed = dict(zip(chart["labels"], chart["datasets"][0]["data"], strict=True))
    assert math.isclose(billed["2026-10-31"], usd["october"], rel_tol=1e-6)  # its first day: the part in the window
    assert math.isclose(view["month_spend_usd"], usd["november"], rel_tol=1e-9)  # November's: the view's month
