"""Invariants over random fleets and requests (hypothesis)."""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Sequence

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from sched_kit import GiB, hashes
from sched_kit import region as sched_region

from prfaas.control_plane.scheduling import (
    ClusterSnapshot,
    Context,
    Decision,
    DisaggregationRule,
    Explanation,
    GlobalScheduler,
    Link,
    Mode,
    ModelShape,
    PlacementRejected,
    Profile,
    Region,
    RejectReason,
    Request,
    Role,
    Slo,
    Stage,
    WeightedScorer,
    build_scheduler,
    default_registry,
)
from prfaas.control_plane.scheduling.costmodel import CodecOption, CostModel
from prfaas.control_plane.scheduling.plugins import Candidate
from prfaas.control_plane.scheduling.scorers import relative_to_best
from prfaas.sim.synthetic import synthetic_requests, synthetic_snapshot

SCHEDULER = build_scheduler()
# The default policy with a low split threshold, so random fleets split often (the invariants
# hold for any threshold; the default's 19,400 would leave most random prompts local).
LOW_THRESHOLD = GlobalScheduler(
    SCHEDULER.decode, SCHEDULER.prefill, SCHEDULER.cost_model, DisaggregationRule(min_uncached_tokens=1_000)
)
MAX_HEARTBEAT_AGE_S = 15.0  # the default policy's health filter
MAX_LINK_UTILIZATION = 0.9  # the default policy's link-headroom filter
BLOCK_TOKENS = 512


@st.composite
def regions(draw: st.DrawFn, index: int) -> Region:
    workers = draw(st.integers(1, 4))
    return Region(
        name=f"g{index}",
        role=draw(st.sampled_from(list(Role))),
        gpu_type="X",
        num_gpus=workers * draw(st.sampled_from([1, 2, 8])),
        num_workers=workers,
        usd_per_gpu_hour=draw(st.floats(0.5, 10.0)),
        spot_usd_per_gpu_hour=draw(st.none() | st.floats(0.1, 5.0)),
        queue_depth=draw(st.sampled_from([0, 0, 0, 1, 3, 8])),
        queue_capacity=draw(st.sampled_from([None, None, 2, 6])),
        num_busy_workers=draw(st.integers(0, workers)),
        mean_prefill_s=draw(st.floats(0.0, 3.0)),
        kv_buffer_free_bytes=draw(st.sampled_from([0, GiB, 8 * GiB, 64 * GiB, 64 * GiB])),
        prefill_tokens_per_s=draw(st.floats(1_000.0, 80_000.0)),
        decode_tokens_per_s=draw(st.floats(500.0, 10_000.0)),
        tpot_ms=draw(st.sampled_from([30.0, 80.0]) | st.floats(10.0, 120.0)),
        healthy=draw(st.sampled_from([True] * 9 + [False])),
        heartbeat_age_s=draw(st.sampled_from([0.0, 0.0, 0.0, 5.0, 14.9, 15.0, 15.1, 60.0])),
        cached_prefix_hashes=frozenset(hashes(draw(st.integers(0, 60)))),
    )


@st.composite
def snapshots(draw: st.DrawFn) -> ClusterSnapshot:
    members = [draw(regions(i)) for i in range(draw(st.integers(2, 6)))]
    links = [
        Link(
            src=a.name,
            dst=b.name,
            rtt_ms=draw(st.floats(0.0, 200.0)),
            bandwidth_gbps=draw(st.sampled_from([0.0, 1.0, 10.0, 100.0, 100.0])),
            utilization=draw(st.sampled_from([0.0, 0.3, 0.85, 0.9, 0.95, 1.0])),
            egress_usd_per_gb=draw(st.floats(0.0, 0.1)),
        )
        for a in members
        for b in members
        if a is not b and draw(st.sampled_from([True, True, False]))
    ]
    model = ModelShape(
        name="m",
        num_layers=draw(st.integers(1, 80)),
        kv_bytes_per_token=draw(st.sampled_from([1_024, 16_384, 65_536])),
    )
    return ClusterSnapshot(model=model, regions=tuple(members), links=tuple(links))


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[ClusterSnapshot, Request]:
    snapshot = draw(snapshots())
    names = [r.name for r in snapshot.regions]
    prompt = draw(st.sampled_from([300, 3_000, 20_000, 45_000, 60_000]) | st.integers(1, 60_000))
    overrides = draw(st.sampled_from([{}, {}, {}]) | st.dictionaries(st.sampled_from(names), st.integers(0, prompt)))
    request = Request(
        tenant="t",
        prompt_tokens=prompt,
        max_new_tokens=draw(st.integers(1, 2_000)),
        slo=Slo(
            ttft_ms=draw(st.sampled_from([200.0, 2_000.0, 10_000.0, 30_000.0]) | st.floats(50.0, 30_000.0)),
            tpot_ms=draw(st.sampled_from([40.0, 200.0]) | st.floats(10.0, 200.0)),
        ),
        uncached_tokens=overrides,
        prefix_block_hashes=hashes(draw(st.integers(0, min(60, prompt // BLOCK_TOKENS)))),
        block_tokens=BLOCK_TOKENS,
        allowed_regions=draw(st.sampled_from([None, None, None]) | st.frozensets(st.sampled_from(names))),
        priority=draw(st.sampled_from(["low", "normal", "high"])),
        allow_lossy_codec=draw(st.booleans()),
    )
    return snapshot, request


@st.composite
def split_scenarios(draw: st.DrawFn) -> tuple[ClusterSnapshot, Request]:
    """Fleets where splitting pays: g0 decodes with room but prefills slowly at a high price, and
    every other region has a fast link into it. Health, heartbeats, residency, queues, prices
    and roles of the others still vary, so the filters still have work to do."""
    snapshot = draw(snapshots())
    decode = snapshot.regions[0].model_copy(
        update={
            "role": Role.DECODE,
            "usd_per_gpu_hour": 20.0,
            "prefill_tokens_per_s": 1_000.0,
            "kv_buffer_free_bytes": 64 * GiB,
            "tpot_ms": 30.0,
        }
    )
    others = snapshot.regions[1:]
    links = [link for link in snapshot.links if link.dst != decode.name]
    for region in others:
        links.append(
            Link(
                src=region.name,
                dst=decode.name,
                rtt_ms=draw(st.sampled_from([5.0, 50.0, 150.0])),
                bandwidth_gbps=100.0,
                utilization=draw(st.sampled_from([0.0, 0.5, 0.95])),
                egress_usd_per_gb=0.01,
            )
        )
    fleet = ClusterSnapshot(model=snapshot.model, regions=(decode, *others), links=tuple(links))
    names = [r.name for r in fleet.regions]
    request = Request(
        tenant="t",
        prompt_tokens=draw(st.integers(20_000, 60_000)),
        max_new_tokens=draw(st.integers(1, 500)),
        slo=Slo(ttft_ms=60_000.0, tpot_ms=200.0),
        allowed_regions=draw(st.sampled_from([None, None]) | st.frozensets(st.sampled_from(names))),
        priority=draw(st.sampled_from(["low", "normal", "high"])),
        allow_lossy_codec=draw(st.booleans()),
    )
    return fleet, request


def _outcome(
    scheduler: GlobalScheduler, snapshot: ClusterSnapshot, request: Request
) -> Decision | tuple[type[PlacementRejected], RejectReason, str, Explanation]:
    try:
        return scheduler.decide(snapshot, request)
    except PlacementRejected as exc:
        return (type(exc), exc.reason, exc.message, exc.explanation)


@settings(max_examples=400, deadline=None)
@given(scenarios() | split_scenarios())
def test_decisions_never_pick_an_unhealthy_excluded_or_full_region(scenario: tuple[ClusterSnapshot, Request]) -> None:
    snapshot, request = scenario
    outcome = _outcome(LOW_THRESHOLD, snapshot, request)
    if isinstance(outcome, tuple):
        event(f"rejected: {outcome[1]}")
        return
    decision = outcome
    event(f"decided: {decision.mode}")
    decode = snapshot.region(decision.decode_region)
    prefill = snapshot.region(decision.prefill_region)
    for region in (decode, prefill):
        assert region.healthy and region.heartbeat_age_s <= MAX_HEARTBEAT_AGE_S
        assert request.allows(region.name)
        assert not region.queue_full or (region is decode and decision.mode is Mode.SPLIT)
    assert decode.can_decode
    needed = (request.prompt_tokens + request.max_new_tokens) * snapshot.model.kv_bytes_per_token
    assert decode.kv_buffer_free_bytes >= needed
    assert decision.predicted_ttft_ms <= request.slo.ttft_ms
    assert decision.predicted_tpot_ms <= request.slo.tpot_ms
    if decision.mode is Mode.SPLIT:
        assert prefill is not decode and prefill.role is not Role.DECODE
        links = [link for link in snapshot.links_into(decode.name) if link.src == prefill.name]
        assert len(links) == 1 and links[0].utilization <= MAX_LINK_UTILIZATION
        assert request.uncached_in(decode) >= LOW_THRESHOLD.rule.min_uncached_tokens
    else:
        assert prefill is decode


@settings(max_examples=200, deadline=None)
@given(scenarios() | split_scenarios(), st.randoms(use_true_random=False))
def test_same_snapshot_and_request_give_the_same_decision(
    scenario: tuple[ClusterSnapshot, Request], rng: random.Random
) -> None:
    snapshot, request = scenario
    first = _outcome(LOW_THRESHOLD, snapshot, request)
    # Again, with a fresh scheduler and inputs rebuilt from their JSON (what explain reads).
    again = _outcome(
        GlobalScheduler(build_scheduler().decode, build_scheduler().prefill, SCHEDULER.cost_model, LOW_THRESHOLD.rule),
        ClusterSnapshot.model_validate_json(snapshot.model_dump_json()),
        Request.model_validate_json(request.model_dump_json()),
    )
    assert first == again
    # Region and link order in the snapshot does not change the choice (ties break by name).
    members, links = list(snapshot.regions), list(snapshot.links)
    rng.shuffle(members)
    rng.shuffle(links)
    shuffled = ClusterSnapshot(model=snapshot.model, regions=tuple(members), links=tuple(links))
    reordered = _outcome(LOW_THRESHOLD, shuffled, request)
    if isinstance(first, tuple):
        assert isinstance(reordered, tuple) and reordered[:2] == first[:2]
    else:
        assert not isinstance(reordered, tuple)
        key = ("mode", "decode_region", "prefill_region", "codec", "num_streams", "predicted_ttft_ms", "cost")
        assert [getattr(reordered, k) for k in key] == [getattr(first, k) for k in key]


class _FixedScorer:
    """Returns the given raw values in candidate order (however wild)."""

    def __init__(self, values: Sequence[float]) -> None:
        self.values = values

    def score(self, ctx: Context, candidates: Sequence[Candidate]) -> list[float]:
        return [self.values[i % len(self.values)] for i in range(len(candidates))]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.floats(allow_nan=True, allow_infinity=True), min_size=1, max_size=6),
    st.floats(0.0, 10.0),
)
def test_framework_clamps_scores_to_unit_interval_before_weighting(values: list[float], weight: float) -> None:
    snapshot = synthetic_snapshot(6, 12, seed=3)
    scheduler = GlobalScheduler(
        Profile(scorers=(WeightedScorer("wild", weight, _FixedScorer(values)),)),
        Profile(),
        SCHEDULER.cost_model,
    )
    request = Request(tenant="t", prompt_tokens=100, max_new_tokens=1, slo=Slo(ttft_ms=1e9, tpot_ms=1e9))
    stage = scheduler.decide(snapshot, request).explanation.stages[0]
    decoders = [r.name for r in snapshot.regions if r.can_decode]  # no filters: all survive, in order
    assert sorted(stage.scores) == sorted(decoders)
    for i, name in enumerate(decoders):
        value = values[i % len(values)]
        expected = 0.0 if math.isnan(value) else min(1.0, max(0.0, value))
        assert 0.0 <= stage.scores[name]["wild"] <= weight
        assert stage.scores[name]["wild"] == weight * expected
        assert stage.totals[name] == weight * expected


@settings(max_examples=150, deadline=None)
@given(scenarios())
def test_builtin_scorers_stay_in_unit_interval_and_ttft_floor_is_a_lower_bound(
    scenario: tuple[ClusterSnapshot, Request],
) -> None:
    snapshot, request = scenario
    registry = default_registry()
    scorers = [registry.make_scorer(t, {}) for t in registry.scorer_types()]
    ctx = Context(snapshot, request, SCHEDULER.cost_model, Stage.DECODE)
    decoders = [Candidate(ctx, r, r, None, r.name) for r in snapshot.regions if r.can_decode]
    groups: list[tuple[Context, list[Candidate]]] = [(ctx, decoders)]
    for decode in decoders:
        pctx = ctx.for_prefill(decode.region)
        split = [
            Candidate(pctx, snapshot.region(link.src), decode.region, link, link.src)
            for link in snapshot.links_into(decode.region.name)
        ]
        groups.append((pctx, [Candidate(pctx, decode.region, decode.region, None, "local"), *split]))
    for group_ctx, candidates in groups:
        if not candidates:
            continue
        if group_ctx.stage is Stage.PREFILL:  # the SLO filter's shortcut is a true lower bound
            for c in candidates:
                floor = c.ttft_floor_s  # before the estimate exists
                assert floor <= c.estimate.ttft_s and floor == pytest.approx(c.ttft_floor_s)
        for scorer in scorers:
            for value in scorer.score(group_ctx, candidates):
                assert 0.0 <= value <= 1.0, (scorer, value)


@given(st.lists(st.floats(0.0, 1e6), min_size=1, max_size=20))
def test_relative_to_best_is_one_for_the_best_and_within_unit_interval(values: list[float]) -> None:
    scores = relative_to_best(values)
    assert all(0.0 <= s <= 1.0 for s in scores)
    assert scores[values.index(min(values))] == 1.0


@given(st.integers(0, 80), st.integers(0, 80), st.integers(1, 64))
def test_uncached_tokens_follow_the_longest_cached_prefix(num_blocks: int, num_cached: int, block_tokens: int) -> None:
    prompt = num_blocks * block_tokens + 7
    region = sched_region("r", Role.DECODE, cached_prefix_hashes=frozenset(hashes(num_cached)))
    request = Request(
        tenant="t",
        prompt_tokens=prompt,
        max_new_tokens=1,
        slo=Slo(ttft_ms=1.0, tpot_ms=1.0),
        prefix_block_hashes=hashes(num_blocks),
        block_tokens=block_tokens,
    )
    assert request.uncached_in(region) == prompt - min(num_blocks, num_cached) * block_tokens


@given(
    st.floats(0.0, 100.0),
    st.floats(0.0, 100.0),
    st.floats(0.0, 0.99),
    st.floats(0.0, 300.0),
    st.integers(0, 10**10),
    st.floats(0.0, 30.0),
    st.integers(1, 100),
)
def test_more_bandwidth_never_slows_the_transfer(
    gbps_a: float, gbps_b: float, util: float, rtt_ms: float, raw: int, prefill_s: float, layers: int
) -> None:
    model = CostModel([CodecOption("raw", 1.0, False), CodecOption("lossless", 1.47, False, 2e9)])
    shape = ModelShape(name="m", num_layers=layers, kv_bytes_per_token=1)
    request = Request(tenant="t", prompt_tokens=1, max_new_tokens=1, slo=Slo(ttft_ms=1.0, tpot_ms=1.0))

    def exposed(gbps: float) -> float:
        link = Link(src="a", dst="b", rtt_ms=rtt_ms, bandwidth_gbps=gbps, utilization=util)
        return model.plan_transfer(request, shape, link, raw, prefill_s, math.inf).exposed_s

    slow, fast = sorted((gbps_a, gbps_b))
    assert exposed(fast) <= exposed(slow)
    assert exposed(fast) >= rtt_ms / 2000.0


def test_synthetic_fleet_exercises_every_outcome() -> None:
    """Keeps the properties honest: the fleets they run on yield splits, locals and rejections."""
    snapshot = synthetic_snapshot(30, 300, seed=7)
    outcomes: Counter[str] = Counter()
    for request in synthetic_requests(snapshot, 300, seed=8):
        try:
            outcomes[SCHEDULER.decide(snapshot, request).mode.value] += 1
        except PlacementRejected as exc:
            outcomes[exc.reason.value] += 1
    assert outcomes["split"] >= 5 and outcomes["local"] >= 100, outcomes
    assert sum(v for k, v in outcomes.items() if k not in ("split", "local")) >= 1, outcomes
