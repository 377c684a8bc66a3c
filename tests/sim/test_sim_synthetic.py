"""sim/synthetic.py: seeded synthetic fleets and the latency rows bench/scheduler.py prints."""

from __future__ import annotations

from prfaas.control_plane.scheduling import build_scheduler
from prfaas.sim.experiment import percentile
from prfaas.sim.synthetic import latency_rows, synthetic_snapshot


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
