"""Table-driven placement specs on the reference fleet (sched_kit's docstring has its figures).
Each row says what the scheduler must choose and why."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

import pytest
from sched_kit import GiB, fleet, hashes, region, request

from prfaas.control_plane.scheduling import (
    ClusterSnapshot,
    DisaggregationRule,
    GlobalScheduler,
    Mode,
    PlacementRejected,
    RejectReason,
    Request,
    Slo,
    build_scheduler,
    default_policy,
    policy_from_mapping,
)
from prfaas.control_plane.scheduling.decision import decision_json
from prfaas.control_plane.scheduling.errors import (
    InsufficientCapacity,
    LinksSaturated,
    NoEligibleRegion,
    NoHealthyRegion,
    ResidencyUnsatisfiable,
    SloUnattainable,
)
from prfaas.control_plane.scheduling.snapshot import Role

SCHEDULER = build_scheduler()


def _without_link_headroom_filter() -> GlobalScheduler:
    document = default_policy().model_dump()
    prefill = document["profiles"]["prefill"]
    prefill["filters"] = [f for f in prefill["filters"] if f["type"] != "link-headroom"]
    return build_scheduler(policy_from_mapping(document))


@dataclass
class Case:
    id: str
    snapshot: ClusterSnapshot
    request: Request
    placement: str  # "dec-east": local in dec-east; "pre-cheap -> dec-east": prefill there, decode here
    cut: dict[str, list[str]] = field(default_factory=dict)  # prefill-stage filter -> labels it must cut
    scheduler: GlobalScheduler = SCHEDULER


SLOW_LINK = {"bandwidth_gbps": 0.5}  # 56 MB/s free: lossless moves 655 MB in ~8 s, TTFT ~7.9 s > 4 s
CHEAPEST = fleet(
    extra_regions=(region("pre-cheapest", Role.PREFILL, usd_per_gpu_hour=1.0),),
    extra_links=(fleet().links[0].model_copy(update={"src": "pre-cheapest", **SLOW_LINK}),),
)
BUSY_DEC_EAST = {"dec-east": {"queue_depth": 5, "num_busy_workers": 1, "mean_prefill_s": 0.5}}
FAST_DEAR_PREFILL = {
    "pre-cheap": {"usd_per_gpu_hour": 18.0, "prefill_tokens_per_s": 60_000.0},
    "pre-mid": {"usd_per_gpu_hour": 20.0},
}
HIGH_THRESHOLD = GlobalScheduler(
    SCHEDULER.decode, SCHEDULER.prefill, SCHEDULER.cost_model, DisaggregationRule(min_uncached_tokens=50_000)
)

# One row a spec: name, fleet, request, expected placement, filters that must cut whom, scheduler.
CASES = [
    # 2,000 tokens < 19,400: split is not even considered; dec-east is the cheaper decode region.
    Case("short prompt stays local", fleet(), request(2_000), "dec-east"),
    # 40k cold tokens: local costs $0.0272; via pre-cheap $0.0139 (-49%) at TTFT 2.69 s <= 4 s.
    # pre-cheapest ($1/GPU-h) is cheaper still, but its 0.5 Gbit/s link cannot meet the 4 s TTFT.
    Case("long cold prompt goes to the cheapest prefill region whose link meets the SLO", CHEAPEST, request(),
         "pre-cheap -> dec-east", cut={"slo": ["pre-cheapest"]}),
    # pre-cheap's link to dec-east is 95% busy (> 0.9 allowed): the dearer pre-mid takes the work.
    Case("saturated cheap link sends work to a dearer feasible region",
         fleet(links={("pre-cheap", "dec-east"): {"utilization": 0.95}}), request(), "pre-mid -> dec-east",
         cut={"link-headroom": ["pre-cheap"]}),
    # Same, with no link-headroom filter in the policy: 99.9% busy leaves 12.5 MB/s, so the
    # transfer alone takes ~36 s and the SLO filter cuts it instead.
    Case("saturated link is cut by the SLO model when no headroom filter is configured",
         fleet(links={("pre-cheap", "dec-east"): {"utilization": 0.999}}), request(), "pre-mid -> dec-east",
         cut={"slo": ["pre-cheap"]}, scheduler=_without_link_headroom_filter()),
    # dec-east holds 2,400 of the prompt's 2,500 16-token blocks: 1,600 uncached < 19,400 -> local.
    Case("prefix-cache hit shrinks the uncached length below the threshold",
         fleet(regions={"dec-east": {"cached_prefix_hashes": frozenset(hashes(2_400))}}),
         request(prefix_block_hashes=hashes(2_500)), "dec-east"),
    # pre-cheap lies outside the allowed regions; pre-mid is the only allowed prefill region.
    Case("residency excludes a prefill region", fleet(), request(allowed_regions=frozenset({"dec-east", "pre-mid"})),
         "pre-mid -> dec-east", cut={"residency": ["pre-cheap"]}),
    # Only dec-west and pre-cheap are allowed: the dearer decode region is the only choice.
    Case("residency excludes the cheaper decode region", fleet(),
         request(allowed_regions=frozenset({"dec-west", "pre-cheap"})), "pre-cheap -> dec-west",
         cut={"residency": ["pre-mid"]}),
    # pre-cheap's last heartbeat is 60 s old (> 15 s): never chosen, pre-mid instead.
    Case("prefill region that missed heartbeats is never chosen",
         fleet(regions={"pre-cheap": {"heartbeat_age_s": 60.0}}), request(), "pre-mid -> dec-east",
         cut={"health": ["pre-cheap"]}),
    # dec-east missed heartbeats: the dearer dec-west decodes (and pre-cheap still prefills).
    Case("decode region that missed heartbeats is never chosen",
         fleet(regions={"dec-east": {"heartbeat_age_s": 60.0}}), request(), "pre-cheap -> dec-west"),
    # dec-east has no room for 40,200 tokens * 16 KiB = 659 MB of KV: dec-west.
    Case("decode region without KV buffer room is skipped",
         fleet(regions={"dec-east": {"kv_buffer_free_bytes": 600_000_000}}), request(), "pre-cheap -> dec-west"),
    # Prefill regions priced like dec-east: split saves nothing (egress makes it dearer) and is
    # slower (15k vs 20k tok/s): the margin rule keeps it local even above the threshold.
    Case("long prompt stays local when split is neither cheaper nor faster by the margin",
         fleet(regions={"pre-cheap": {"usd_per_gpu_hour": 6.0}, "pre-mid": {"usd_per_gpu_hour": 6.0}}), request(),
         "dec-east"),
    # Local prefill in dec-east would take 40k / 5k = 8 s > 4 s SLO: local is cut, split wins even
    # though its margin over local no longer matters.
    Case("split when local misses the SLO", fleet(regions={"dec-east": {"prefill_tokens_per_s": 5_000.0}}),
         request(), "pre-cheap -> dec-east", cut={"slo": ["dec-east (local)"]}),
    # pre-cheap at $18/GPU-h but 60k tok/s: prefill 0.67 s costs what local's 2 s does, plus
    # egress, so split is 17% dearer; but TTFT 0.69 s vs 2 s is >= 10% faster: split.
    # (pre-mid at $20 and 15k tok/s is dearer and slower, so pre-cheap is the best split.)
    Case("split when faster by the margin though not cheaper", fleet(regions=FAST_DEAR_PREFILL), request(),
         "pre-cheap -> dec-east"),
    # The threshold is configuration: at 50,000 the same 40k-token prompt stays local.
    Case("threshold comes from configuration", fleet(), request(), "dec-east", scheduler=HIGH_THRESHOLD),
    # dec-east: its one worker busy, 5 jobs queued, 0.5 s each. A high-priority request only
    # waits for the worker (0.5 s): queue-depth scores 1 / 1.5, dec-east totals 2 + 0.67 and
    # beats dec-west's 2 * 6/8 (price) + 1 (idle) = 2.5.
    Case("high priority skips the queue", fleet(regions=BUSY_DEC_EAST), request(2_000, priority="high"), "dec-east"),
    # At normal priority it would wait (5 + 1) * 0.5 = 3 s: queue-depth scores 0.25, 2.25 < 2.5.
    Case("normal priority waits its turn", fleet(regions=BUSY_DEC_EAST), request(2_000), "dec-west"),
]  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_placement(case: Case) -> None:
    decision = case.scheduler.decide(case.snapshot, case.request)
    prefill, _, decode = case.placement.rpartition(" -> ")
    expected = (Mode.SPLIT, decode, prefill) if prefill else (Mode.LOCAL, decode, decode)
    assert (decision.mode, decision.decode_region, decision.prefill_region) == expected
    assert decision.predicted_ttft_ms <= case.request.slo.ttft_ms
    last = decision.explanation.stages[-1]
    for filter_name, labels in case.cut.items():
        assert last.cut.get(filter_name) == labels, last.cut


def test_long_cold_prompt_decision_carries_the_predicted_figures() -> None:
    decision = SCHEDULER.decide(fleet(), request())
    # 40,000 tokens * 16 KiB = 655,360,000 bytes raw; lossless (1.47) is the fewest wire bytes
    # whose transfer still fits the TTFT budget (int8 is lossy and not allowed by the request).
    assert decision.codec == "lossless"
    assert decision.kv_bytes_raw == 655_360_000
    assert decision.kv_bytes_wire == 445_823_130
    # 90 Gbit/s free * 40 ms RTT = 450 MB in flight / 4 MiB windows -> 108 streams, capped at 64.
    assert decision.num_streams == 64
    # prefill 40k / 15k = 2,666.7 ms, + last layer (655 MB / 60 / 2 GB/s = 5.5 ms) + half RTT 20 ms.
    assert decision.predicted_ttft_ms == pytest.approx(2_692.1, abs=0.1)
    assert decision.predicted_tpot_ms == 30.0
    assert decision.cost.prefill_usd == pytest.approx(2.6667 * 8 * 1.5 / 3600, rel=1e-4)
    assert decision.cost.egress_usd == pytest.approx(0.445823130 * 0.01)
    assert decision.cost.decode_usd == pytest.approx(200 / 5_000 * 8 * 6.0 / 3600)
    assert decision.colocated_cost.prefill_usd == pytest.approx(2.0 * 8 * 6.0 / 3600)
    assert decision.colocated_cost.total_usd == pytest.approx(0.0272)
    assert decision.cost.total_usd < decision.colocated_cost.total_usd * 0.9
    assert decision.explanation.verdict.startswith(
        "split via pre-cheap: $0.013880 vs $0.027200 local (+49.0% cheaper), "
        "TTFT 2692 ms vs 2000 ms local (34.6% slower)"
    )  # a slower split is said slower (it read "-34.6% faster")
    prefill_stage = decision.explanation.stages[-1]
    assert prefill_stage.ranking == ["pre-cheap", "pre-mid"]
    # price weight 3: pre-cheap is cheapest (3.0); pre-mid's $0.0153 vs $0.0094 scores 3 * 0.61.
    assert prefill_stage.scores["pre-cheap"]["price"] == pytest.approx(3.0)
    assert prefill_stage.scores["pre-mid"]["price"] == pytest.approx(3 * 0.009422 / 0.015347, rel=1e-3)


def test_a_lossy_codec_only_with_consent_and_only_where_it_pays() -> None:
    fast = SCHEDULER.decide(fleet(), request(allow_lossy_codec=True))
    assert fast.codec == "lossless"  # 25 ms of its 2.7 s TTFT exposed: a lossy codec would save nothing worth its error
    # 1 Gbit/s: lossless (1.47x) leaves ~1 s of 3.6 s exposed, >= 20 %: int8 (2.19x) pays, the fewest wire bytes
    slow = {(p, d): {"bandwidth_gbps": 1.0} for p in ("pre-cheap", "pre-mid") for d in ("dec-east", "dec-west")}
    consented = SCHEDULER.decide(fleet(links=slow), request(allow_lossy_codec=True, lossy_codec="int8"))
    assert consented.codec == "int8"  # the one codec consented to (any lossy one: kv4, the fewest bytes)
    assert consented.kv_bytes_wire == math.ceil(655_360_000 / 2.19)
    strict = SCHEDULER.decide(fleet(links=slow), request())  # no consent: never lossy
    assert strict.codec is None and strict.mode is Mode.LOCAL  # lossless over 1 Gbit/s misses the 4 s TTFT SLO


def test_local_decision_has_no_transfer() -> None:
    decision = SCHEDULER.decide(fleet(), request(2_000))
    assert (decision.codec, decision.num_streams, decision.kv_bytes_raw, decision.kv_bytes_wire) == (None, 0, 0, 0)
    assert decision.cost == decision.colocated_cost
    assert decision.uncached_tokens == 2_000
    assert "split not considered" in decision.explanation.verdict


@dataclass
class Rejection:
    id: str
    snapshot: ClusterSnapshot
    request: Request
    error: type[PlacementRejected]
    reason: RejectReason


def _all(names: tuple[str, ...], **fields: Any) -> dict[str, dict[str, Any]]:
    return {name: dict(fields) for name in names}


DECODERS = ("dec-east", "dec-west")
ALL_LINKS_BUSY = {(p, d): {"utilization": 0.95} for p in ("pre-cheap", "pre-mid") for d in DECODERS}
PREFILL_ONLY = ClusterSnapshot(model=fleet().model, regions=(fleet().region("pre-cheap"),))
REJECTIONS = [
    # 100 ms TTFT: local prefill alone takes 2 s, split 2.7 s.
    Rejection("no region meets the SLO", fleet(), request(slo=Slo(ttft_ms=100.0, tpot_ms=50.0)), SloUnattainable,
              RejectReason.SLO),
    # Every decode region's TPOT (30 ms) misses a 10 ms objective: cut in the decode stage.
    Rejection("no region meets the TPOT", fleet(), request(slo=Slo(ttft_ms=4_000.0, tpot_ms=10.0)), SloUnattainable,
              RejectReason.SLO),
    # Only a prefill region is allowed: nothing may decode.
    Rejection("residency", fleet(), request(allowed_regions=frozenset({"pre-cheap"})), ResidencyUnsatisfiable,
              RejectReason.RESIDENCY),
    Rejection("no KV buffer room", fleet(regions=_all(DECODERS, kv_buffer_free_bytes=GiB // 4)), request(),
              InsufficientCapacity, RejectReason.CAPACITY),
    Rejection("every decode region missed heartbeats", fleet(regions=_all(DECODERS, heartbeat_age_s=30.0)), request(),
              NoHealthyRegion, RejectReason.UNHEALTHY),
    Rejection("every decode region reports unhealthy", fleet(regions=_all(DECODERS, healthy=False)), request(),
              NoHealthyRegion, RejectReason.UNHEALTHY),
    # Decode queues full (local impossible) and every link 95% busy.
    Rejection("links saturated and local queues full",
              fleet(regions=_all(DECODERS, queue_depth=4, queue_capacity=4, num_busy_workers=1), links=ALL_LINKS_BUSY),
              request(), LinksSaturated, RejectReason.LINK_SATURATED),
    Rejection("no region can decode", PREFILL_ONLY, request(), NoEligibleRegion, RejectReason.NO_ELIGIBLE_REGION),
]  # fmt: skip


@pytest.mark.parametrize("case", REJECTIONS, ids=[c.id for c in REJECTIONS])
def test_rejection(case: Rejection) -> None:
    with pytest.raises(PlacementRejected) as info:
        SCHEDULER.decide(case.snapshot, case.request)
    assert type(info.value) is case.error
    assert info.value.reason is case.reason
    assert info.value.message and str(info.value) == info.value.message


def test_rejection_explains_which_filter_cut_whom() -> None:
    with pytest.raises(SloUnattainable) as info:
        SCHEDULER.decide(fleet(), request(slo=Slo(ttft_ms=100.0, tpot_ms=50.0)))
    stages = info.value.explanation.stages
    # decode stage, then the prefill stage of both decode regions (max 4 tried, 2 exist)
    assert [(s.stage.value, s.decode_region) for s in stages] == [
        ("decode", None),
        ("prefill", "dec-east"),
        ("prefill", "dec-west"),
    ]
    assert stages[1].cut == {"slo": ["dec-east (local)", "pre-cheap", "pre-mid"]}
    assert "dec-east" in info.value.message and "'slo'" in info.value.message


def test_prefill_only_region_is_never_a_decode_region() -> None:
    snapshot = fleet(regions=_all(DECODERS, healthy=False))
    assert snapshot.region("pre-cheap").role is Role.PREFILL
    with pytest.raises(NoHealthyRegion) as info:
        SCHEDULER.decide(snapshot, request())
    assert info.value.explanation.stages[0].num_candidates == 2  # only the two decode regions


def test_kv_is_counted_in_each_regions_dtype_and_splits_only_between_alike_regions() -> None:
    bf16 = {"kv_dtype": "bfloat16"}
    model = fleet().model.model_copy(update={"kv_dtype": "float32"})  # the figure is float32's
    alike = fleet(regions={"dec-east": bf16, "dec-west": bf16, "pre-cheap": bf16, "pre-mid": bf16})
    decision = SCHEDULER.decide(alike.model_copy(update={"model": model}), request())
    assert decision.mode is Mode.SPLIT and decision.kv_bytes_raw == 655_360_000 // 2  # shipped in bf16
    mixed = fleet(regions={"pre-cheap": bf16, "pre-mid": bf16})  # bf16 prefill, fp32 (unsaid) decode: alike
    assert SCHEDULER.decide(mixed, request()).mode is Mode.SPLIT
    fp32 = {"kv_dtype": "float32"}
    unlike = fleet(regions={"dec-east": fp32, "dec-west": fp32, "pre-cheap": bf16, "pre-mid": bf16})
    decision = SCHEDULER.decide(unlike.model_copy(update={"model": model}), request())
    assert decision.mode is Mode.LOCAL  # a decode region refuses KV of another dtype: no split candidate
    assert "0 split candidates" in str(decision.explanation)


def test_a_region_is_aged_by_its_own_heartbeat_interval() -> None:
    """The `health` filter allows a region `max_missed_heartbeats` (3) of its own intervals when that is
    longer than `max_heartbeat_age_s` (15 s): the registry counts a region beating every 30 s (regions may
    beat every 60 s) alive for 90 s. (Before, it was cut 15 s after each beat though alive.)"""
    every_30_s = {"heartbeat_interval_s": 30.0}
    between_beats = fleet(regions={"pre-cheap": every_30_s | {"heartbeat_age_s": 29.0}})
    decision = SCHEDULER.decide(between_beats, request())
    assert decision.prefill_region == "pre-cheap" and "health" not in decision.explanation.stages[1].cut
    three_missed = fleet(regions={"pre-cheap": every_30_s | {"heartbeat_age_s": 91.0}})  # 91 s > 3 x 30 s
    decision = SCHEDULER.decide(three_missed, request())
    assert decision.prefill_region == "pre-mid" and decision.explanation.stages[1].cut["health"] == ["pre-cheap"]
    beating_fast = fleet(regions={"pre-cheap": {"heartbeat_interval_s": 1.0, "heartbeat_age_s": 16.0}})
    assert SCHEDULER.decide(beating_fast, request()).prefill_region == "pre-mid"  # 15 s, the policy's floor


def test_a_region_whose_kv_room_is_split_over_instances_cannot_take_a_reservation_none_holds() -> None:
    """A reservation lands on one instance: the `capacity` filter checks the largest free buffer of one, not
    the sum. 40,200 tokens x 16 KiB = 659 MB; dec-east has 1 GB free over two instances of 500 MB each.
    (Before, the sum passed and the reservation was refused by the instance it landed on.)"""
    split_room = {"kv_buffer_free_bytes": 1_000_000_000, "kv_buffer_largest_free_bytes": 500_000_000}
    decision = SCHEDULER.decide(fleet(regions={"dec-east": split_room}), request())
    assert decision.decode_region == "dec-west" and decision.explanation.stages[0].cut == {"capacity": ["dec-east"]}
    one_holds = split_room | {"kv_buffer_largest_free_bytes": 700_000_000}
    assert SCHEDULER.decide(fleet(regions={"dec-east": one_holds}), request()).decode_region == "dec-east"


def test_a_free_local_region_is_not_beaten_by_a_dearer_slower_split() -> None:
    """min_cost_gain 0 ('split when at least as cheap'), dec-east priced $0: any split costs more (prefill GPUs,
    egress), so it gains -inf, not 0 %, and local stays. (Before, a $0 local counted as a 0 % gain and the
    dearer, slower split won.)"""
    document = default_policy().model_dump()
    document["disaggregation"]["min_cost_gain"] = 0.0
    at_par = build_scheduler(policy_from_mapping(document))
    free = fleet(regions={"dec-east": {"usd_per_gpu_hour": 0.0}})  # local TTFT 2.0 s, split 2.69 s
    decision = at_par.decide(free, request())
    assert decision.mode is Mode.LOCAL and decision.decode_region == "dec-east"
    assert "not cheaper: local's is 0" in decision.explanation.verdict
    assert json.loads(decision_json(decision))["explanation"]["verdict"] == decision.explanation.verdict
    from prfaas.control_plane.scheduling.scheduler import gain  # here: the figures above are the spec

    assert gain(0.0, 0.0) == 0.0 and gain(0.01, 0.0) == -math.inf and gain(1.0, 4.0) == 0.75
    decision = at_par.decide(fleet(regions={"dec-east": {"usd_per_gpu_hour": 8.0}}), request())
    assert decision.mode is Mode.SPLIT  # a priced local still loses to the cheaper split
