"""`prfaas bench` workloads and figures, without a deployment: same seed, same requests;
lengths follow their spec; shared prefixes are shared; percentiles interpolate."""

from __future__ import annotations

import itertools
import statistics

import pytest

from prfaas.loadgen.report import percentile
from prfaas.loadgen.workload import WorkloadError, WorkloadSpec, parse_lengths, plan

CORPUS = list(range(1000, 3000))


def test_the_same_seed_plans_the_same_requests() -> None:
    spec = WorkloadSpec(50, 5.0, input_len="uniform:10-100", output_len="lognormal:20,0.5", seed=7)
    assert plan(spec, CORPUS, 512) == plan(spec, CORPUS, 512)
    assert plan(spec, CORPUS, 512) != plan(WorkloadSpec(50, 5.0, seed=8), CORPUS, 512)


def test_poisson_arrivals_average_the_rate() -> None:
    reqs = plan(WorkloadSpec(2000, 10.0, seed=1), CORPUS, 512)
    gaps = [b.at_s - a.at_s for a, b in itertools.pairwise(reqs)]
    assert statistics.mean(gaps) == pytest.approx(0.1, rel=0.08)
    assert statistics.stdev(gaps) / statistics.mean(gaps) == pytest.approx(1.0, rel=0.1)  # exponential: CV 1


def test_bursty_gamma_arrivals_have_the_asked_cv() -> None:
    reqs = plan(WorkloadSpec(3000, 10.0, burstiness=3.0, seed=2), CORPUS, 512)
    gaps = [b.at_s - a.at_s for a, b in itertools.pairwise(reqs)]
    assert statistics.stdev(gaps) / statistics.mean(gaps) == pytest.approx(3.0, rel=0.15)


def test_lengths_follow_their_spec_and_the_model_limit() -> None:
    reqs = plan(WorkloadSpec(300, None, input_len="uniform:10-100", output_len="fixed:9"), CORPUS, 64)
    assert all(10 <= len(r.prompt) <= 64 for r in reqs)  # 64: the model's limit clips uniform:10-100
    assert {r.max_tokens for r in reqs} == {9}
    assert {r.at_s for r in reqs} == {0.0}  # closed loop: no schedule


def test_a_named_mix_draws_both_classes() -> None:
    reqs = plan(WorkloadSpec(400, None, mix="chat-rag"), CORPUS, 4096)
    by_class = {k: [len(r.prompt) for r in reqs if r.klass == k] for k in ("chat", "rag")}
    assert 0.6 < len(by_class["chat"]) / 400 < 0.8
    assert max(by_class["chat"]) <= 128 < statistics.median(by_class["rag"])


def test_shared_prefix_requests_share_their_group_prefix() -> None:
    reqs = plan(WorkloadSpec(60, None, input_len="fixed:200", shared_prefix_tokens=120, prefix_groups=3), CORPUS, 512)
    groups = {r.prefix_group for r in reqs}
    assert groups == {0, 1, 2}
    for group in groups:
        heads = {r.prompt[:120] for r in reqs if r.prefix_group == group}
        assert len(heads) == 1
    assert len({r.prompt[120:] for r in reqs}) > 50  # the rest differs


@pytest.mark.parametrize(
    ("spec", "message"),
    [("gauss:3", "not fixed:N, uniform"), ("uniform:9-3", "not fixed:N"), ("fixed:0", "lengths start at 1")],
)
def test_bad_length_specs_name_the_option(spec: str, message: str) -> None:
    with pytest.raises(WorkloadError, match=f"--input-len: .*{message}"):
        parse_lengths(spec, "--input-len")


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("lognormal:nan,0.5", "MEDIAN and SIGMA must be finite"),  # passed, then plan() raised ValueError
        ("lognormal:300,nan", "MEDIAN and SIGMA must be finite"),
        ("lognormal:1e400,0.5", "MEDIAN and SIGMA must be finite"),  # float() reads it as inf: OverflowError
        ("lognormal:300,inf", "MEDIAN and SIGMA must be finite"),
        ("lognormal:300,1000", "SIGMA must be between 0 and 10"),  # every draw overflowed exp()
        ("lognormal:300,-1", "SIGMA must be between 0 and 10"),
        ("lognormal:0.5,0.3", "lengths start at 1"),
    ],
)
def test_lognormal_specs_that_cannot_be_sampled_are_refused_by_validate(spec: str, message: str) -> None:
    # validate() is what `prfaas bench` checks before it runs (exit 2 naming the option, not a traceback)
    with pytest.raises(WorkloadError, match=f"^--input-len: '{spec}': {message}"):
        WorkloadSpec(3, None, input_len=spec).validate()


def test_a_lognormal_tail_past_what_a_float_holds_is_clipped_to_the_model_limit() -> None:
    # median 1e308 (finite, valid): about every other draw was past exp()'s range (OverflowError in plan)
    reqs = plan(WorkloadSpec(40, None, input_len="lognormal:1e308,10", output_len="lognormal:1e308,10"), CORPUS, 64)
    assert {len(r.prompt) for r in reqs} == {64}
    assert {r.max_tokens for r in reqs} == {1 << 20}  # the output's limit in plan()


def test_bad_workload_options_are_refused() -> None:
    with pytest.raises(WorkloadError, match="--mix: unknown mix 'nope'"):
        plan(WorkloadSpec(5, None, mix="nope"), CORPUS, 512)
    with pytest.raises(WorkloadError, match="--rate"):
        plan(WorkloadSpec(5, -1.0), CORPUS, 512)


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize(
    ("options", "option"),
    [
        ({"rate_rps": NAN}, "--rate"),  # nan <= 0 is False: it passed, and planned every arrival at nan s
        ({"rate_rps": INF}, "--rate"),  # every gap 0 s: the whole run at once
        ({"burstiness": NAN}, "--burstiness"),  # plan() hung in random.gammavariate
        ({"burstiness": INF}, "--burstiness"),
        ({"max_duration_s": NAN}, "--max-duration-s"),
        ({"max_duration_s": 0.0}, "--max-duration-s"),
    ],
)
def test_rates_and_burstiness_that_are_not_finite_positive_numbers_are_refused(options: dict[str, float],
                                                                                option: str) -> None:  # fmt: skip
    spec = WorkloadSpec(**{"num_requests": 3, "rate_rps": 1.0, **options})  # type: ignore[arg-type]
    with pytest.raises(WorkloadError, match=f"^{option}: .* must be a positive number"):
        spec.validate()  # validate, not plan: plan() never returned for a nan burstiness


def test_an_open_loop_whose_arrivals_run_past_the_cap_is_refused() -> None:
    # 3 requests at 1e-6 req/s: the first arrival alone is ~1e6 s (11 days) away
    with pytest.raises(WorkloadError, match=r"--max-duration-s: at --rate 1e-06 .* past 3600 s"):
        plan(WorkloadSpec(3, 1e-6), CORPUS, 512)
    # 50 requests at 1 req/s (~50 s) fit the default cap, not a 10 s one
    assert plan(WorkloadSpec(50, 1.0), CORPUS, 512)[-1].at_s < 3600
    with pytest.raises(WorkloadError, match="past 10 s"):
        plan(WorkloadSpec(50, 1.0, max_duration_s=10.0), CORPUS, 512)
    assert plan(WorkloadSpec(50, None, max_duration_s=1.0), CORPUS, 512)  # closed loop: no schedule to cap


def test_percentile_interpolates_like_numpy() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5  # halfway between the 2nd and 3rd
    assert percentile([5.0], 99) == 5.0
    assert percentile([], 50) is None
    assert percentile(list(map(float, range(101))), 90) == 90.0
