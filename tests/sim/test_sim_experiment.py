"""A run's figures (sim/experiment.py): what they count from."""

from __future__ import annotations

from dataclasses import replace

import pytest

from prfaas.sim.experiment import RunMetrics, measure
from prfaas.sim.policies import naive_heterogeneous_policy
from prfaas.sim.scenarios import small
from prfaas.sim.workload import Arrival


def _run(arrivals: list[Arrival]) -> RunMetrics:
    scenario = small()
    return measure(scenario.fleet, naive_heterogeneous_policy(), scenario.slo, arrivals, 2.0)


def test_duration_based_figures_count_from_the_first_arrival_not_from_zero() -> None:
    # the same 30 requests, arriving from 0 s or from 3600 s: the idle hour before the first is not part of the
    # run, so the GPU-hours paid, the link's Gbit/s and the GPUs' utilization must not change (they were ~100x off)
    arrivals = small().workload.generate(2.0, 30, seed=1)
    at_zero = _run([replace(a, at_s=a.at_s - arrivals[0].at_s) for a in arrivals])
    an_hour_in = _run([replace(a, at_s=a.at_s - arrivals[0].at_s + 3600.0) for a in arrivals])
    assert an_hour_in.duration_s == pytest.approx(at_zero.duration_s, rel=1e-6)
    assert an_hour_in.duration_s < 60.0  # 30 requests at 2 req/s and their decodes, not an hour
    assert an_hour_in.usd_per_mtok == pytest.approx(at_zero.usd_per_mtok, rel=1e-6)
    assert an_hour_in.link_gbps == pytest.approx(at_zero.link_gbps, rel=1e-6)
    assert an_hour_in.gpu_util == pytest.approx(at_zero.gpu_util, rel=1e-6)
