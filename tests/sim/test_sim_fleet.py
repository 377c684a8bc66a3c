"""The fleet's spec (sim/fleet.py): a region or link no deployment could have is refused where it is written."""

from __future__ import annotations

from typing import Any

import pytest

from prfaas.sim.fleet import FleetSpec, LinkSpec, RegionSpec


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        # a link from a region to itself: the scheduler was offered a "split" from pd to pd, egress paid
        ({"src": "pd", "dst": "pd"}, "pd->pd: a link joins two regions"),
        ({"rtt_ms": -50.0}, "rtt_ms must be >= 0"),  # simpy's "Negative delay" mid-run
        ({"rtt_ms": float("nan")}, "rtt_ms must be >= 0"),
        ({"bandwidth_gbps": -5.0}, "bandwidth_gbps must be >= 0"),  # silently a dead link
        ({"efficiency": 0.0}, r"efficiency .* must be in \(0, 1\]"),  # silently a dead link
        ({"efficiency": 1.5}, r"efficiency .* must be in \(0, 1\]"),  # more goodput than line rate
        ({"egress_usd_per_gb": -0.01}, "egress_usd_per_gb must be >= 0"),
    ],
)
def test_a_link_no_path_could_be_is_refused(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LinkSpec(**({"src": "cheap", "dst": "pd", "bandwidth_gbps": 25.0, "rtt_ms": 10.0} | fields))


def test_a_dead_link_is_a_link() -> None:
    # 0 Gbit/s is a link that carries nothing (the simulator's zero-bandwidth tests), not an error
    assert LinkSpec("cheap", "pd", 0.0, 10.0).goodput_bytes_per_s == 0.0


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"num_prefill_workers": -1}, "worker counts must be >= 0"),  # simpy's '"capacity" must be > 0'
        ({"num_decode_workers": -2}, "worker counts must be >= 0"),
        ({"gpus_per_worker": 0}, "gpus_per_worker must be >= 1"),  # free workers: $0 per token
    ],
)
def test_a_region_no_deployment_could_be_is_refused(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=f"region x: {message}"):
        RegionSpec(**({"name": "x", "gpu": "H100", "num_prefill_workers": 1, "num_decode_workers": 2} | fields))


def test_a_fleet_with_a_self_loop_is_refused_before_any_run() -> None:
    pd = RegionSpec("pd", "H100", 2, 2, gpus_per_worker=1)
    with pytest.raises(ValueError, match="a link joins two regions"):
        FleetSpec("dense-8b", (pd,), (LinkSpec("pd", "pd", 25.0, 10.0),))


def test_shared_slots_count_their_gpus_once() -> None:
    # 3 shared slots of 2 GPUs: the prefill and decode counts name the same 3 engines, so 6 GPUs (not 12), and the
    # fleet (plus a separate 1 x 2-GPU PD worker pair: 4 GPUs) 10; usd_per_mtok and usd_per_hour are GPUs x price
    shared = RegionSpec("d", "H100", 3, 3, gpus_per_worker=2, shared_workers=True)
    separate = RegionSpec("pd", "H100", 1, 1, gpus_per_worker=2)
    assert (shared.num_gpus, separate.num_gpus) == (6, 4)
    assert FleetSpec("dense-8b", (shared, separate)).num_gpus == 10
