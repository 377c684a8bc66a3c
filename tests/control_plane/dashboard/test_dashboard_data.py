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
