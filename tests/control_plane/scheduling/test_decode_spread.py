"""Decode load over several decode regions, with the default policy: equal regions share the
requests (the picker's tie band orders equal candidates by request), headroom moves the
share, and a region whose batch fills does not draw the rest (decode is priced at the
nominal rate, not the measured one that rises with the batch)."""

from __future__ import annotations

from collections import Counter
from typing import Any

from sched_kit import MODEL, GiB, link, region, request

from prfaas.control_plane.scheduling import ClusterSnapshot, Role, build_scheduler

REQUESTS = 200


def _fleet(**decode: dict[str, Any]) -> ClusterSnapshot:
    regions = [region(name, Role.DECODE, kv_buffer_bytes=200 * GiB, **fields) for name, fields in decode.items()]
    regions.append(region("pre", Role.PREFILL))
    links = tuple(link("pre", name) for name in decode)
    return ClusterSnapshot(taken_at_s=1.7e9, model=MODEL, regions=tuple(regions), links=links)


def _shares(snapshot: ClusterSnapshot) -> Counter[str]:
    scheduler = build_scheduler()
    return Counter(
        scheduler.decide(snapshot, request(1_000, request_id=f"job-{i}")).decode_region for i in range(REQUESTS)
    )


def test_equal_decode_regions_share_the_load_within_60_40() -> None:
    shares = _shares(_fleet(a={}, b={}))

    assert set(shares) == {"a", "b"}
    assert max(shares.values()) <= 0.6 * REQUESTS, shares


def test_the_same_request_gets_the_same_region_every_time() -> None:
    scheduler = build_scheduler()
    snapshot = _fleet(a={}, b={})
    picks = {scheduler.decide(snapshot, request(1_000, request_id="job-7")).decode_region for _ in range(5)}
    assert len(picks) == 1


def test_a_region_whose_batch_fills_does_not_draw_every_request() -> None:
    # a's measured rate doubled with its batch; both have the same nominal (full-batch) rate
    busy, idle = {"decode_tokens_per_s": 10_000.0}, {"decode_tokens_per_s": 5_000.0}
    nominal = {"decode_nominal_tokens_per_s": 12_000.0}

    shares = _shares(_fleet(a=busy | nominal, b=idle | nominal))
    herded = _shares(_fleet(a=busy, b=idle))  # priced at the measured rate: the busy one looks cheapest

    assert max(shares.values()) <= 0.6 * REQUESTS, shares
    assert herded["a"] == REQUESTS


def test_headroom_moves_the_share_to_the_region_with_kv_to_spare() -> None:
    shares = _shares(_fleet(a={"kv_buffer_free_bytes": 20 * GiB}, b={}))

    assert shares["b"] >= 0.9 * REQUESTS, shares
