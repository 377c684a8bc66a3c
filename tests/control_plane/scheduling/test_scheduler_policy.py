"""Policy YAML, the plugin registry and the framework's bookkeeping."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import yaml
from pydantic import ValidationError
from sched_kit import fleet, request

from prfaas.control_plane.scheduling import (
    DEFAULT_POLICY_YAML,
    ClusterSnapshot,
    Context,
    CostModel,
    GlobalScheduler,
    NamedFilter,
    Picker,
    PolicyConfigError,
    Profile,
    RejectReason,
    Stage,
    UnknownPluginType,
    WeightedScorer,
    build_scheduler,
    default_policy,
    default_registry,
    parse_policy,
    policy_from_mapping,
)
from prfaas.control_plane.scheduling.costmodel import CodecOption
from prfaas.control_plane.scheduling.filters import CapacityFilter, HealthFilter, ResidencyFilter, SloFilter
from prfaas.control_plane.scheduling.plugins import Candidate
from prfaas.control_plane.scheduling.policy import load_policy
from prfaas.control_plane.scheduling.scheduler import PluginContractError
from prfaas.control_plane.scheduling.scorers import PriceScorer


def _policy(**changes: Any) -> dict[str, Any]:
    """The default policy as a mapping, with top-level sections replaced."""
    document: dict[str, Any] = yaml.safe_load(DEFAULT_POLICY_YAML)
    document.update(changes)
    return document


def _with_prefill(filters: list[dict[str, Any]] | None = None, scorers: list[dict[str, Any]] | None = None) -> str:
    document = _policy()
    prefill = document["profiles"]["prefill"]
    if filters is not None:
        prefill["filters"] = filters
    if scorers is not None:
        prefill["scorers"] = scorers
    return yaml.safe_dump(document)


def test_default_policy_uses_only_registered_plugins() -> None:
    policy = default_policy()
    registry = default_registry()
    for profile in (policy.profiles.decode, policy.profiles.prefill):
        assert {f.type for f in profile.filters} <= set(registry.filter_types())
        assert {s.type for s in profile.scorers} <= set(registry.scorer_types())
        assert profile.picker.type in registry.picker_types()
    scheduler = build_scheduler(policy)
    assert [f.name for f in scheduler.prefill.filters] == ["health", "residency", "capacity", "link-headroom", "slo"]
    assert scheduler.rule.min_uncached_tokens == 19_400
    codecs = ["raw", "lossless", "int8", "kv8", "kv6", "kv4", "kvw6", "kvw4"]
    assert [c.name for c in scheduler.cost_model.codecs] == codecs


def test_load_policy_reads_a_file(tmp_path: Any) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(DEFAULT_POLICY_YAML.replace("min_uncached_tokens: 19400", "min_uncached_tokens: 8000"))
    assert load_policy(path).disaggregation.min_uncached_tokens == 8_000
    with pytest.raises(PolicyConfigError, match="cannot read policy"):
        load_policy(tmp_path / "missing.yaml")


@pytest.mark.parametrize(
    ("text", "field", "message"),
    [
        # an unknown plugin type names the entry and lists the known ones
        (
            _with_prefill(filters=[{"type": "health"}, {"type": "moon-phase"}]),
            "profiles.prefill.filters[1].type",
            "unknown filter type 'moon-phase'",
        ),
        # a plugin validates its own parameters
        (
            _with_prefill(filters=[{"type": "health", "params": {"max_heartbeat_age_s": -1}}]),
            "profiles.prefill.filters[0].params.max_heartbeat_age_s",
            "greater than 0",
        ),
        # ... and refuses parameters it does not have (typos)
        (
            _with_prefill(filters=[{"type": "link-headroom", "params": {"max_utilisation": 0.5}}]),
            "profiles.prefill.filters[0].params.max_utilisation",
            "Extra inputs",
        ),
        (
            _with_prefill(scorers=[{"type": "price", "weight": -2}]),
            "profiles.prefill.scorers[0].weight",
            "greater than or equal to 0",
        ),
        (
            _with_prefill(scorers=[{"type": "queue-depth", "params": {"half_score_wait_s": "soon"}}]),
            "profiles.prefill.scorers[0].params.half_score_wait_s",
            "valid number",
        ),
        (
            yaml.safe_dump(_policy(disaggregation={"min_cost_gain": 1.5})),
            "disaggregation.min_cost_gain",
            "less than 1",
        ),
        (
            yaml.safe_dump(_policy(transfer={"codecs": [{"name": "int8", "compression_ratio": 2.19, "lossy": True}]})),
            "transfer",
            "at least one codec must be lossless",
        ),
        (yaml.safe_dump(_policy(transfer={"codecs": [{"name": "raw", "compression_ratio": 0.5}]})), "transfer", "1"),
        (yaml.safe_dump(_policy(version=2)), "version", "1"),
        (yaml.safe_dump(_policy(surprise=True)), "surprise", "Extra inputs"),
        (
            _with_prefill(scorers=[{"type": "price"}, {"type": "price"}]),
            "profiles.prefill",
            "two scorers named 'price'",
        ),
        ("profiles: [unclosed", "", "not valid YAML"),
        ("- just\n- a list\n", "", "must be a YAML mapping"),
    ],
)
def test_bad_policy_is_a_typed_error_naming_the_field(text: str, field: str, message: str) -> None:
    with pytest.raises(PolicyConfigError) as info:
        build_scheduler(parse_policy(text))
    assert info.value.field.startswith(field), info.value.field
    assert message in str(info.value)


DECODE_FILTERS = "profiles:\n  decode:\n    filters:\n"


@pytest.mark.parametrize(
    ("text", "field", "lines"),
    [
        # a tuned section added at the top, the old one left below: the later silently won
        ("disaggregation: {min_uncached_tokens: 4000}\n" + DEFAULT_POLICY_YAML, "disaggregation", "lines 1 and "),
        # a second `filters:` in one profile dropped the first list (health and residency with it)
        (
            DEFAULT_POLICY_YAML.replace(DECODE_FILTERS, DECODE_FILTERS + "      - {type: capacity}\n    filters:\n"),
            "profiles.decode.filters",
            "lines ",
        ),
        # within one flow mapping of a list entry
        (
            DEFAULT_POLICY_YAML.replace("{type: residency}", "{type: residency, type: slo}", 1),
            "profiles.decode.filters[1].type",
            "lines ",
        ),
    ],
    ids=["top-level section", "profile list", "flow mapping"],
)
def test_a_key_repeated_in_the_policy_is_an_error_naming_it(text: str, field: str, lines: str) -> None:
    """YAML loaders keep a repeated key's last value and say nothing; a policy refuses it, naming the key's
    path and both lines. (Before, these loaded, the operator's first value lost.)"""
    with pytest.raises(PolicyConfigError) as info:
        parse_policy(text)
    assert info.value.field == field
    assert "key repeated" in info.value.message and lines in info.value.message


def test_unknown_plugin_type_error_lists_known_types() -> None:
    with pytest.raises(UnknownPluginType) as info:
        build_scheduler(parse_policy(_with_prefill(filters=[{"type": "moon-phase"}])))
    assert "health" in info.value.message and "residency" in info.value.message


def test_two_instances_of_one_plugin_type_need_distinct_names() -> None:
    text = _with_prefill(scorers=[{"type": "price", "weight": 3}, {"type": "price", "name": "price-again"}])
    scheduler = build_scheduler(parse_policy(text))
    assert [s.name for s in scheduler.prefill.scorers] == ["price", "price-again"]


def test_weights_from_yaml_decide_between_cheap_and_fast() -> None:
    # pre-cheap: $1.5/GPU-h at 15k tok/s: prefill $0.0089, TTFT 2.69 s.
    # pre-mid made fast and dear: $12/GPU-h at 60k tok/s: prefill $0.0178, TTFT 0.69 s.
    # price 5 + latency 1: pre-cheap 5 + 0.26 beats pre-mid 5 * 0.51 + 1; latency 5 + price 1 reverses it.
    snapshot = fleet(regions={"pre-mid": {"usd_per_gpu_hour": 12.0, "prefill_tokens_per_s": 60_000.0}})
    cheap_first = _with_prefill(scorers=[{"type": "price", "weight": 5}, {"type": "latency", "weight": 1}])
    fast_first = _with_prefill(scorers=[{"type": "price", "weight": 1}, {"type": "latency", "weight": 5}])
    assert build_scheduler(parse_policy(cheap_first)).decide(snapshot, request()).prefill_region == "pre-cheap"
    assert build_scheduler(parse_policy(fast_first)).decide(snapshot, request()).prefill_region == "pre-mid"


class _PreferNamed:
    def __init__(self, name: str) -> None:
        self.name = name

    def score(self, ctx: Context, candidates: Sequence[Candidate]) -> list[float]:
        return [1.0 if c.region.name == self.name else 0.0 for c in candidates]


def test_custom_plugin_registers_on_its_own_registry() -> None:
    registry = default_registry()

    def factory(params: Any) -> _PreferNamed:
        return _PreferNamed(str(params["region"]))

    registry.register_scorer("prefer", factory)
    with pytest.raises(ValueError, match="already registered"):
        registry.register_scorer("prefer", factory)
    assert "prefer" not in default_registry().scorer_types()  # no shared global state
    text = _with_prefill(scorers=[{"type": "price"}, {"type": "prefer", "weight": 10, "params": {"region": "pre-mid"}}])
    decision = build_scheduler(parse_policy(text), registry).decide(fleet(), request())
    assert decision.prefill_region == "pre-mid"
    with pytest.raises(UnknownPluginType):
        build_scheduler(parse_policy(text))  # the default registry does not know it


def test_scheduler_is_built_from_plain_values_without_yaml() -> None:
    cost_model = CostModel([CodecOption("raw", 1.0, False)])
    filters = (NamedFilter("health", HealthFilter()), NamedFilter("residency", ResidencyFilter()))
    scheduler = GlobalScheduler(
        decode=Profile((*filters, NamedFilter("capacity", CapacityFilter()))),
        prefill=Profile((*filters, NamedFilter("slo", SloFilter(ttft_margin=0.1)))),
        cost_model=cost_model,
    )
    decision = scheduler.decide(fleet(), request(2_000))
    assert (decision.decode_region, decision.mode.value) == ("dec-east", "local")  # name order breaks the tie


SLOW_S = 0.002  # each call of a _Slow* plugin sleeps this long, so its timing is at least 2,000 µs


class _SlowFilter:
    reason = RejectReason.CAPACITY

    def keep(self, ctx: Context, candidate: Candidate) -> bool:
        time.sleep(SLOW_S)
        return True


class _SlowScorer:
    def score(self, ctx: Context, candidates: Sequence[Candidate]) -> list[float]:
        time.sleep(SLOW_S)
        return [0.0] * len(candidates)


@dataclass(frozen=True)
class _SlowPicker:
    inner: Picker

    def rank(self, ctx: Context, candidates: Sequence[Candidate], totals: Sequence[float]) -> list[Candidate]:
        time.sleep(SLOW_S)
        return self.inner.rank(ctx, candidates, totals)


def test_every_plugin_is_timed_and_timings_do_not_affect_equality() -> None:
    scheduler = build_scheduler()
    first = scheduler.decide(fleet(), request())
    second = scheduler.decide(fleet(), request())
    decode_stage, prefill_stage = first.explanation.stages
    assert set(decode_stage.timings_us) == {"health", "residency", "capacity", "slo", "price", "prefix-cache"} | {
        "queue-depth",
        "decode-headroom",
        "picker",
    }
    assert set(prefill_stage.timings_us) >= {"link-headroom", "egress-cost", "picker"}
    # perf_counter_ns over real work: two runs never time every plugin to the same nanosecond ...
    assert decode_stage.timings_us != second.explanation.stages[0].timings_us
    assert first == second  # ... yet the decisions are equal: timings are not part of equality


def test_a_plugin_timing_is_its_wall_time_in_microseconds() -> None:
    base = build_scheduler()
    decode = Profile(
        filters=(*base.decode.filters, NamedFilter("slow-filter", _SlowFilter())),
        scorers=(*base.decode.scorers, WeightedScorer("slow-scorer", 1.0, _SlowScorer())),
        picker=_SlowPicker(base.decode.picker),
    )
    scheduler = GlobalScheduler(decode, base.prefill, base.cost_model, base.rule, base.max_decode_regions_tried)
    timings = scheduler.decide(fleet(), request()).explanation.stages[0].timings_us
    assert timings["slow-filter"] >= 2 * SLOW_S * 1e6  # called once per decode candidate (2 in the fleet)
    assert timings["slow-scorer"] >= SLOW_S * 1e6  # one call for all candidates
    assert timings["picker"] >= SLOW_S * 1e6
    assert timings["slow-scorer"] < 1e6  # microseconds, not nanoseconds: 2 ms reads 2,000, not 2,000,000


class _WrongLength:
    def score(self, ctx: Context, candidates: Sequence[Candidate]) -> list[float]:
        return [0.5]


def test_scorer_returning_the_wrong_number_of_scores_is_a_contract_error() -> None:
    scheduler = GlobalScheduler(
        Profile(scorers=(WeightedScorer("short", 1.0, _WrongLength()),)),
        Profile(),
        CostModel([CodecOption("raw", 1.0, False)]),
    )
    with pytest.raises(PluginContractError, match="'short' returned 1 scores for 2 candidates"):
        scheduler.decide(fleet(), request())


def test_price_scorer_scores_relative_to_the_cheapest() -> None:
    snapshot = fleet()
    ctx = Context(snapshot, request(), build_scheduler().cost_model, Stage.DECODE)
    candidates = [Candidate(ctx, r, r, None, r.name) for r in snapshot.regions if r.can_decode]
    # decode $ scales with $/GPU-h: dec-east $6 is the cheapest, dec-west $8 scores 6/8.
    assert PriceScorer().score(ctx, candidates) == pytest.approx([1.0, 0.75])


def test_policy_from_mapping_accepts_a_parsed_document() -> None:
    assert policy_from_mapping(_policy()) == default_policy()


def _link(src: str, dst: str) -> dict[str, Any]:
    return {"src": src, "dst": dst, "rtt_ms": 1, "bandwidth_gbps": 1}


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"regions": [{"name": "x"}]}, "regions.0.role\n  Field required"),
        ({"links": [_link("dec-east", "nowhere")]}, "unknown region 'nowhere'"),
        ({"links": [_link("dec-east", "dec-east")]}, "link from 'dec-east' to itself"),
        ({"regions_extra": 1}, "regions_extra\n  Extra inputs are not permitted"),
    ],
)
def test_bad_snapshot_names_the_field(change: dict[str, Any], expected: str) -> None:
    document = fleet().model_dump(mode="json") | change
    with pytest.raises(ValidationError) as info:
        ClusterSnapshot.model_validate(document)
    assert expected in str(info.value)


def test_snapshot_rejects_inconsistent_regions() -> None:
    document = fleet().model_dump(mode="json")
    document["regions"].append(document["regions"][0])
    with pytest.raises(ValidationError, match="duplicate region name 'dec-east'"):
        ClusterSnapshot.model_validate(document)
    document = fleet().model_dump(mode="json")
    document["regions"][0]["num_busy_workers"] = 5
    with pytest.raises(ValidationError, match="num_busy_workers"):
        ClusterSnapshot.model_validate(document)
