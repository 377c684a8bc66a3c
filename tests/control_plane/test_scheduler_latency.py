"""A guard against accidental slowness, not the benchmark (bench/scheduler.py measures P50/P99
at 10, 100 and 1,000 regions; the target is P99 <= 1 ms at 100 regions). The median here has
wide headroom so a busy CI machine does not trip it; a quadratic pass over links would."""

from __future__ import annotations

from prfaas.control_plane import build_scheduler
from prfaas.control_plane.synthetic import (
    decision_latencies_ms,
    latency_rows,
    percentile,
    synthetic_requests,
    synthetic_snapshot,
)


def test_median_decision_at_100_regions_is_under_a_millisecond() -> None:
    snapshot = synthetic_snapshot(100, 1_000, seed=1)
    requests = synthetic_requests(snapshot, 300, seed=2)
    scheduler = build_scheduler()
    decision_latencies_ms(scheduler, snapshot, requests[:20])  # warm caches
    latencies = decision_latencies_ms(scheduler, snapshot, requests)
    print(f"100 regions: p50 {percentile(latencies, 50):.3f} ms, p99 {percentile(latencies, 99):.3f} ms")
    assert percentile(latencies, 50) <= 1.0


def test_synthetic_fleet_is_deterministic_and_sized_as_asked() -> None:
    first = synthetic_snapshot(10, 1_000, seed=5)
    assert first == synthetic_snapshot(10, 1_000, seed=5)
    assert first != synthetic_snapshot(10, 1_000, seed=6)
    assert sum(r.num_workers for r in first.regions) == 1_000
    assert len(first.regions) == 10
    assert all(first.region(link.dst).can_decode for link in first.links)
    assert percentile([3.0, 1.0, 2.0, 4.0], 50) == 2.0 and percentile([3.0, 1.0, 2.0, 4.0], 99) == 4.0


def test_latency_rows_have_the_bench_columns() -> None:
    rows = latency_rows(build_scheduler(), (3, 5), num_workers=20, num_requests=10)
    assert [row["regions"] for row in rows] == [3, 5]
    assert all(0.0 < row["p50_ms"] <= row["p99_ms"] for row in rows)
