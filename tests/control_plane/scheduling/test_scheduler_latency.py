"""A guard against accidental slowness, not the benchmark (bench/scheduler.py measures P50/P99
at 10, 100 and 1,000 regions; the target is P99 <= 1 ms at 100 regions). The median here has
wide headroom so a busy CI machine does not trip it; a quadratic pass over links would."""

from __future__ import annotations

from prfaas.control_plane.scheduling import build_scheduler
from prfaas.sim.experiment import percentile
from prfaas.sim.synthetic import decision_latencies_ms, synthetic_requests, synthetic_snapshot


def test_median_decision_at_100_regions_is_under_a_millisecond() -> None:
    snapshot = synthetic_snapshot(100, 1_000, seed=1)
    requests = synthetic_requests(snapshot, 300, seed=2)
    scheduler = build_scheduler()
    decision_latencies_ms(scheduler, snapshot, requests[:20])  # warm caches
    latencies = decision_latencies_ms(scheduler, snapshot, requests)
    print(f"100 regions: p50 {percentile(latencies, 50):.3f} ms, p99 {percentile(latencies, 99):.3f} ms")
    assert percentile(latencies, 50) <= 1.0
