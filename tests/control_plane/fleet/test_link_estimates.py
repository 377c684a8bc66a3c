"""Link estimates from the senders' reports (control_plane/fleet/links.py): smoothing, the
configured figures as the prior, staleness. The registry folding heartbeats in: test_region_registry.py."""

from __future__ import annotations

import pytest

from prfaas.control_plane.fleet.links import PRIOR_S, SENDER_QUIET_S, STALE_S, TAU_S, LinkEstimate, effective, merged
from prfaas.control_plane.scheduling.snapshot import Link
from prfaas.protos.prfaas.v1 import registry_pb2

LINK = Link(src="pre", dst="dec", rtt_ms=80.0, bandwidth_gbps=10.0, egress_usd_per_gb=0.02)
NOW = 1_700_000_000.0


def link_report(
    gbps: float, seconds: float = 5.0, *, backlogged: bool = True, rtt_ms: float = 40.0
) -> registry_pb2.LinkReport:
    sent = int(gbps * 1e9 / 8 * seconds)
    return registry_pb2.LinkReport(
        peer_region="dec", seconds=seconds, bytes_acked=sent, backlogged_s=seconds if backlogged else 0.0,
        backlogged_bytes=sent if backlogged else 0, srtt_ms=rtt_ms + 5, min_rtt_ms=rtt_ms, retransmits=3,
    )  # fmt: skip


def test_the_configured_link_holds_until_the_path_was_measured_then_the_measurement_takes_over() -> None:
    empty = LinkEstimate(src="pre", dst="dec")
    assert effective(LINK, None, NOW) == LINK

    small = empty.updated(link_report(2.0, seconds=0.1), now=NOW)  # 0.1 s of PRIOR_S: mostly the prior
    blended = effective(LINK, small, now=NOW)
    assert 2.0 < blended.bandwidth_gbps < 10.0 and blended.bandwidth_gbps > 9.0
    assert blended.rtt_ms == 40.0  # a measured RTT replaces the configured one at once

    big = empty.updated(link_report(2.0, seconds=30.0), now=NOW)  # the measurement alone
    assert big.weight == 1.0 and big.backlogged_s >= PRIOR_S
    assert effective(LINK, big, now=NOW).bandwidth_gbps == pytest.approx(2.0)
    assert effective(LINK, big, now=NOW + STALE_S + 1) == LINK  # stale: the configured link again


def test_a_rate_change_is_followed_within_a_few_time_constants() -> None:
    estimate = LinkEstimate(src="pre", dst="dec").updated(link_report(8.0, seconds=60.0), now=NOW)
    for step in range(5):  # the path drops to 1/10 for 5 x TAU_S of measurement
        estimate = estimate.updated(link_report(0.8, seconds=TAU_S), now=NOW + step)
    assert estimate.measured_gbps == pytest.approx(0.8, rel=0.1)


def test_producer_limited_windows_measure_no_goodput_but_count_as_use() -> None:
    estimate = LinkEstimate(src="pre", dst="dec").updated(link_report(8.0, seconds=60.0), now=NOW)
    idle_ish = estimate.updated(link_report(0.5, seconds=60.0, backlogged=False), now=NOW)
    assert idle_ish.measured_gbps == pytest.approx(8.0)  # a slow prefill says nothing of the path
    assert idle_ish.sending_bytes_per_s * 8 / 1e9 == pytest.approx(0.5, rel=0.01)
    assert effective(LINK, idle_ish, now=NOW).utilization == pytest.approx(0.5 / 8.0, rel=0.02)
    assert idle_ish.retransmits == 6 and idle_ish.bytes_acked > estimate.bytes_acked


def test_concurrent_senders_add_up_and_a_quiet_one_stops_counting() -> None:
    """Two instances of the prefill region at 4.8 Gbit/s each fill 96% of a 10 Gbit/s link (before, their
    reports were smoothed as one sender's: 48%, and the link-headroom filter let the full link through)."""
    estimate = LinkEstimate(src="pre", dst="dec")
    for step in range(30):
        for sender in ("a", "b"):
            estimate = estimate.updated(link_report(4.8, seconds=1.0, backlogged=False), now=NOW + step, sender=sender)
    ten = LINK.model_copy(update={"bandwidth_gbps": 10.0})
    assert effective(ten, estimate, now=NOW + 29).utilization == pytest.approx(0.96, rel=0.01)
    assert effective(ten, estimate, now=NOW + 29 + SENDER_QUIET_S + 1).utilization == 0.0  # both went quiet
    for step in range(30, 60):  # b stops shipping: a alone
        estimate = estimate.updated(link_report(4.8, seconds=1.0, backlogged=False), now=NOW + step, sender="a")
    assert effective(ten, estimate, now=NOW + 59).utilization == pytest.approx(0.48, rel=0.01)


def test_one_beats_channels_to_one_peer_are_merged_into_one_report() -> None:
    """A prefill instance has a channel per decode instance: one beat carries a report of each, at once."""
    reports = [link_report(4.8, seconds=1.0, rtt_ms=40.0), link_report(4.8, seconds=1.0, rtt_ms=50.0)]
    one = merged(reports)
    assert one.bytes_acked == 2 * reports[0].bytes_acked and one.seconds == 1.0 and one.min_rtt_ms == 40.0
    assert one.backlogged_bytes == 2 * reports[0].backlogged_bytes and one.retransmits == 6
    assert one.srtt_ms == pytest.approx(50.0)  # byte-weighted mean of 45 and 55
    odd = registry_pb2.LinkReport(peer_region="dec", seconds=float("nan"), bytes_acked=1)
    assert merged([odd, reports[0]]) == reports[0]  # one channel's impossible figures spoil no other's
