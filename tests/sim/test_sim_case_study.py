"""The PrfaaS case study's inputs: the paper's workload, its 1T model's KV (per-token plus
recurrent state) and profiled timings, checked against the paper's own figures."""

from __future__ import annotations

import random

import pytest

from prfaas.sim import analytic
from prfaas.sim.policies import BASELINES, decode_only_pd_fleet, homogeneous_fleet
from prfaas.sim.profiles import PRFAAS_PROFILES
from prfaas.sim.scenarios import case_study
from prfaas.sim.simulator import Simulation
from prfaas.sim.workload import Arrival, TruncatedLogNormal


def test_truncated_lognormal_stays_inside_and_has_the_papers_mean() -> None:
    dist = TruncatedLogNormal(9.90, 1.00, 128, 131_072)
    rng = random.Random(0)
    draws = [dist.sample(rng) for _ in range(50_000)]
    assert min(draws) >= 128 and max(draws) <= 131_072
    assert sum(draws) / len(draws) == pytest.approx(27_500, rel=0.03)  # "a mean of approximately 27K tokens"
    assert sum(d > 19_400 for d in draws) / len(draws) == pytest.approx(0.496, abs=0.01)  # 49.6 % above 19.4K


@pytest.mark.parametrize("bad", [(9.9, 1.0, 0, 10), (9.9, 1.0, 10, 5), (9.9, -1.0, 1, 10), (30.0, 0.1, 1, 100)])
def test_truncated_lognormal_refuses_an_empty_or_invalid_range(bad: tuple[float, float, int, int]) -> None:
    with pytest.raises(ValueError, match=r"lo|sigma|0\.1%"):
        TruncatedLogNormal(*bad)


def test_profiles_reproduce_the_papers_table_5_prefill_and_its_kv_sizes() -> None:
    h200 = PRFAAS_PROFILES["H200"]
    for tokens, seconds in [(1024, 0.44), (8192, 0.72), (32768, 1.84), (131072, 7.40)]:
        assert h200.prefill_s(tokens) == pytest.approx(seconds, abs=0.02)
    model = case_study().fleet.model_profile
    for tokens, mib in [(1024, 190.8), (8192, 308.9), (32768, 701.3), (131072, 2316.3)]:
        size = model.kv_state_bytes + tokens * model.kv_bytes_per_token
        assert size / 2**20 == pytest.approx(mib, rel=0.02)


def test_the_papers_throughput_model_on_these_profiles_gives_its_table_6() -> None:
    scenario = case_study()
    fleet = scenario.fleet
    lengths, out = analytic.sample_lengths(scenario.workload, 50_000)
    prfaas = analytic.best(fleet, lengths, out, list(range(15_000, 25_001, 200)))
    homogeneous = analytic.best(homogeneous_fleet(fleet), lengths, out, [None])
    naive = analytic.best(decode_only_pd_fleet(fleet), lengths, out, [0])
    # Table 6: t = 19.4K, 3 + 5 instances, 3.24 req/s; homogeneous 9 + 3, 2.11; naive 0 + 8, 2.45
    assert (prfaas.prefill_workers, prfaas.decode_workers) == (3, 5)
    assert prfaas.threshold == pytest.approx(19_400, abs=600)
    assert prfaas.lambda_max == pytest.approx(3.24, rel=0.05)
    assert (homogeneous.prefill_workers, homogeneous.decode_workers) == (9, 3)
    assert homogeneous.lambda_max == pytest.approx(2.11, rel=0.03)
    assert naive.decode_workers == 8 and naive.lambda_max == pytest.approx(2.45, rel=0.05)


def test_a_split_ships_the_recurrent_state_with_the_per_token_kv() -> None:
    scenario = case_study()
    sim = Simulation(scenario.fleet, BASELINES["naive-heterogeneous"]().scheduler(), scenario.slo)
    [record] = sim.run([Arrival(0.0, 32_768, 16)])
    model = scenario.fleet.model_profile
    assert record.mode == "split"
    assert record.kv_raw_bytes == model.kv_state_bytes + 32_768 * model.kv_bytes_per_token
    assert record.wire_bytes < record.kv_raw_bytes  # the codec the scheduler chose (lossless) applies to both
