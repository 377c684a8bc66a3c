"""The WAN link model: shipments share the goodput fairly and never run ahead of their prefill."""

from __future__ import annotations

import math

import pytest
import simpy
from hypothesis import given, settings
from hypothesis import strategies as st

from prfaas.sim.fleet import LinkSpec
from prfaas.sim.links import FluidLink

GBPS_8 = LinkSpec("a", "b", bandwidth_gbps=8.0, rtt_ms=0.0, efficiency=1.0)  # 1e9 bytes/s of goodput


def _finish_times(link_spec: LinkSpec, shipments: list[tuple[float, int, float]], layers: int = 10) -> list[float]:
    """(start s, wire bytes, prefill s) -> when each shipment's last byte left."""
    env = simpy.Environment()
    link = FluidLink(env, link_spec, layers)
    done: list[float] = [math.nan] * len(shipments)

    def one(i: int, start: float, wire: int, prefill_s: float):  # type: ignore[no-untyped-def]
        yield env.timeout(start)
        yield link.ship(wire, prefill_s)
        done[i] = float(env.now)

    for i, (start, wire, prefill_s) in enumerate(shipments):
        env.process(one(i, start, wire, prefill_s))
    env.run()
    assert link.flows == [] and link.bytes_carried == sum(w for _, w, _ in shipments)
    return done


def test_a_lone_shipment_of_a_finished_prefill_moves_at_the_full_goodput() -> None:
    # 2e9 bytes at 1e9 bytes/s: 2 s
    assert _finish_times(GBPS_8, [(0.0, 2_000_000_000, 0.0)]) == pytest.approx([2.0])


def test_two_concurrent_shipments_share_the_link() -> None:
    # each gets 0.5e9 bytes/s: both need 2 s for 1e9 bytes (a FIFO would finish one at 1 s, one at 2 s)
    assert _finish_times(GBPS_8, [(0.0, 1_000_000_000, 0.0), (0.0, 1_000_000_000, 0.0)]) == pytest.approx([2.0, 2.0])


def test_a_late_joiner_slows_the_first_only_while_both_are_in_flight() -> None:
    # first: 0.5e9 alone by t=0.5, then 0.5e9 at half rate -> done at 1.5; second: 0.5e9 by 1.5, then 0.5e9 alone -> 2.0
    times = _finish_times(GBPS_8, [(0.0, 1_000_000_000, 0.0), (0.5, 1_000_000_000, 0.0)])
    assert times == pytest.approx([1.5, 2.0])


def test_layerwise_streaming_is_paced_by_the_prefill_and_sends_the_last_layer_after_it() -> None:
    # 10 layers of 1e8 bytes over a 4 s prefill: 9 layers stream during it, the last (1e8 at 1e9 B/s) takes 0.1 s more
    assert _finish_times(GBPS_8, [(0.0, 1_000_000_000, 4.0)]) == pytest.approx([4.1])


def test_paced_shipments_leave_their_unused_share_to_others() -> None:
    # paced flow uses 0.225e9 B/s (9e8 over 4 s); the bulk one gets the other 0.775e9: 1e9 bytes in 1.29 s
    times = _finish_times(GBPS_8, [(0.0, 1_000_000_000, 4.0), (0.0, 1_000_000_000, 0.0)])
    assert times[1] == pytest.approx(1e9 / 0.775e9)
    assert times[0] == pytest.approx(4.1)


def test_utilization_is_the_share_in_use_not_the_backlog() -> None:
    # the sim_speed bug: a 10 GB shipment streaming at its prefill's pace used to read as a saturated link
    env = simpy.Environment()
    link = FluidLink(env, LinkSpec("a", "b", 100.0, 10.0), 80)
    link.ship(10_000_000_000, 3.0)
    assert 0.25 < link.utilization < 0.35  # ~3.3e9 B/s of 11.25e9


def test_a_dead_link_refuses_a_shipment() -> None:
    env = simpy.Environment()
    link = FluidLink(env, LinkSpec("a", "b", 0.0, 10.0), 10)
    assert link.utilization == 1.0
    with pytest.raises(AssertionError, match="zero-bandwidth"):
        link.ship(1000, 1.0)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.floats(0.0, 5.0), st.integers(0, 3_000_000_000), st.floats(0.0, 5.0)
        ),  # (start s, wire bytes, prefill s)
        min_size=1,
        max_size=12,
    )
)
def test_every_shipment_arrives_no_sooner_than_physics_allows(shipments: list[tuple[float, int, float]]) -> None:
    # conservation (checked in _finish_times: every flow leaves, bytes carried = bytes shipped) and two lower
    # bounds: a shipment cannot beat the link's full goodput, nor leave before its prefill ends plus its last layer
    layers = 10
    times = _finish_times(GBPS_8, shipments, layers)
    total = sum(wire for _, wire, _ in shipments)
    for (start, wire, prefill_s), end in zip(shipments, times, strict=True):
        assert end >= start + wire / 1e9 - 1e-6
        assert end >= start + prefill_s + wire / layers / 1e9 - 1e-6
    # work conservation: the link is never idle while bytes wait, so the last one leaves by then at the latest
    last_ready = max(start + prefill_s for start, _, prefill_s in shipments)
    assert max(times) <= last_ready + total / 1e9 + 1e-6


EPOCH_S = 1.7e9  # a trace in Unix seconds: a float step of the clock is 2.4e-7 s there


def _run_bounded(env: simpy.Environment, max_events: int = 10_000) -> None:
    """env.run(), failing (not hanging) when the events never run out: a timer that does not advance the clock."""
    for _ in range(max_events):
        if env.peek() == math.inf:
            return
        env.step()
    pytest.fail(f"still running after {max_events} events, at t = {env.now!r}")


def test_shipments_finish_at_an_epoch_sized_clock() -> None:
    # the reviewer's case: at t = 1.7e9 a shipment's last 1,222 bytes at 10.9 GB/s take 1.1e-7 s, under one float
    # step of the clock: env.now + delay == env.now, so the link used to wake at the same instant forever
    env = simpy.Environment(initial_time=EPOCH_S)
    link = FluidLink(env, LinkSpec("a", "b", 100.0, 10.0), 32)
    done: list[float] = []

    def go():  # type: ignore[no-untyped-def]
        events = []
        for i in range(3):
            yield env.timeout(0.0137 * (i + 1))
            events.append(link.ship(123_456_789 + i, 0.731))
        for event in events:
            yield event
            done.append(float(env.now))

    env.process(go())
    _run_bounded(env)
    assert len(done) == 3 and link.flows == [] and link.num_splits == 3
    # 3 x 123 MB paced by 0.731 s prefills on an 11.25 GB/s link: each ends ~its last layer after its prefill
    assert done[-1] - EPOCH_S == pytest.approx(0.0137 * 6 + 0.731 + 123_456_791 / 32 / 11.25e9, abs=1e-3)


def test_a_shipment_never_leaves_faster_than_its_max_rate() -> None:
    # the codec's encode rate or the streams' windows per round trip: 1e9 bytes capped at 0.25e9 B/s take 4 s on a
    # 1e9 B/s link, and leave the other 0.75e9 B/s to a second shipment (1.5e9 bytes: 2 s at that share)
    env = simpy.Environment()
    link = FluidLink(env, GBPS_8, 10)
    slow, fast = link.ship(1_000_000_000, 0.0, max_rate=0.25e9), link.ship(1_500_000_000, 0.0)
    assert link.rate_in_use == pytest.approx(1e9)
    env.run(slow)
    assert float(env.now) == pytest.approx(4.0) and fast.processed
    assert link.bytes_carried == 2_500_000_000
