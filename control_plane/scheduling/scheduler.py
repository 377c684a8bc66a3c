"""`GlobalScheduler`: snapshot and request in, `Decision` out (or a typed rejection).

1. Decode profile over the regions that can decode: filter, score, rank.
2. For the best decode regions in order (at most `max_decode_regions_tried`), the prefill
   profile over {the decode region prefilling locally} + {each region with a link into it},
   split candidates only when the decode region's uncached prompt reaches the threshold.
   Filters judge all; scorers and the picker rank the split candidates. Before the policy's
   filters, regions a retry leaves out (`Region.excluded`) are cut, traced as `excluded`.
3. Conditional disaggregation: the best split wins when local was cut, or when it is
   predicted cheaper or faster than local by the configured margin. Otherwise local.

Pure: no I/O, no clock except `perf_counter` for the per-plugin timings in the trace.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from prfaas.control_plane.scheduling.costmodel import CostModel
from prfaas.control_plane.scheduling.decision import Cost, Decision, Explanation, Mode, StageTrace
from prfaas.control_plane.scheduling.errors import RejectReason, SchedulerError, rejection
from prfaas.control_plane.scheduling.plugins import Candidate, Context, Filter, Picker, Scorer, Stage
from prfaas.control_plane.scheduling.request import Request
from prfaas.control_plane.scheduling.scorers import MaxScorePicker
from prfaas.control_plane.scheduling.snapshot import ClusterSnapshot, Region


class PluginContractError(SchedulerError):
    """A plugin broke its contract (a scorer returned the wrong number of scores)."""


@dataclass(frozen=True)
class NamedFilter:
    """A filter and the name its cuts are traced under (the policy's plugin name)."""

    name: str
    plugin: Filter


@dataclass(frozen=True)
class WeightedScorer:
    """A scorer, the name its points are traced under, and its weight. A candidate's points from it:
    weight x its score clamped to [0, 1] (the framework clamps, weights and sums; see `_rank`)."""

    name: str
    weight: float
    plugin: Scorer


@dataclass(frozen=True)
class Profile:
    """Filters in order (put the ones that need estimates, like `slo`, last: they cost most),
    weighted scorers, and the picker."""

    filters: Sequence[NamedFilter] = ()
    scorers: Sequence[WeightedScorer] = ()
    picker: Picker = field(default_factory=MaxScorePicker)


@dataclass(frozen=True)
class DisaggregationRule:
    """Split only when the decode region's uncached prompt is at least `min_uncached_tokens`,
    a split survives the filters (so meets the SLO), and it is cheaper than local by
    `min_cost_gain` or faster to first token by `min_ttft_gain` (fractions), or local was cut."""

    min_uncached_tokens: int = 19_400
    min_cost_gain: float = 0.1
    min_ttft_gain: float = 0.1

    NEVER = 1 << 62  # min_uncached_tokens of a rule that never splits (a request that asked for local)


def clamp01(value: float) -> float:
    """Clamp to [0, 1]; NaN becomes 0."""
    if value >= 1.0:
        return 1.0
    if value >= 0.0:
        return float(value)
    return 0.0


@dataclass
class _Filtered:
    survivors: list[Candidate]
    cut: dict[str, list[str]]
    emptied_by: RejectReason | None  # reason of the filter that cut the last candidate
    emptied_by_name: str


@dataclass
class _Ranked:
    ranking: list[Candidate]
    scores: dict[str, dict[str, float]]
    totals: dict[str, float]


EXCLUDED = "excluded"  # the cut of regions a retry leaves out: every healthy instance failed the request before


def _filter(profile: Profile, ctx: Context, candidates: list[Candidate], timings: dict[str, float]) -> _Filtered:
    survivors = [c for c in candidates if not c.region.excluded]
    cut: dict[str, list[str]] = {}
    if len(survivors) < len(candidates):  # the request's own exclusions, whatever the policy (not unhealthy)
        cut[EXCLUDED] = [c.label for c in candidates if c.region.excluded]
        if not survivors:
            return _Filtered([], cut, RejectReason.UNHEALTHY, EXCLUDED)
    for named in profile.filters:
        start = time.perf_counter_ns()
        keep = named.plugin.keep
        kept: list[Candidate] = []
        removed: list[str] = []
        for candidate in survivors:
            if keep(ctx, candidate):
                kept.append(candidate)
            else:
                removed.append(candidate.label)
        timings[named.name] = (time.perf_counter_ns() - start) / 1000.0
        if removed:
            cut[named.name] = removed
        survivors = kept
        if not survivors:
            return _Filtered([], cut, named.plugin.reason, named.name)
    return _Filtered(survivors, cut, None, "")


def _rank(profile: Profile, ctx: Context, candidates: list[Candidate], timings: dict[str, float]) -> _Ranked:
    totals = [0.0] * len(candidates)
    scores: dict[str, dict[str, float]] = {c.label: {} for c in candidates}
    for weighted in profile.scorers:
        start = time.perf_counter_ns()
        raw = weighted.plugin.score(ctx, candidates)
        if len(raw) != len(candidates):
            raise PluginContractError(
                f"scorer {weighted.name!r} returned {len(raw)} scores for {len(candidates)} candidates"
            )
        for i, value in enumerate(raw):
            points = weighted.weight * clamp01(value)
            totals[i] += points
            scores[candidates[i].label][weighted.name] = points
        timings[weighted.name] = (time.perf_counter_ns() - start) / 1000.0
    start = time.perf_counter_ns()
    ranking = profile.picker.rank(ctx, candidates, totals)
    timings["picker"] = (time.perf_counter_ns() - start) / 1000.0
    return _Ranked(ranking, scores, {c.label: totals[i] for i, c in enumerate(candidates)})


class GlobalScheduler:
    """Composed of plain values; build one from YAML with `policy.build_scheduler`."""

    def __init__(
        self,
        decode: Profile,
        prefill: Profile,
        cost_model: CostModel,
        rule: DisaggregationRule | None = None,
        max_decode_regions_tried: int = 4,
    ) -> None:
        if max_decode_regions_tried < 1:
            raise ValueError("max_decode_regions_tried must be at least 1")
        self.decode = decode
        self.prefill = prefill
        self.cost_model = cost_model
        self.rule = rule or DisaggregationRule()
        self.max_decode_regions_tried = max_decode_regions_tried

    def decide(self, snapshot: ClusterSnapshot, request: Request) -> Decision:
        """Place `request` on `snapshot`. Raises a `PlacementRejected` subclass when nothing fits;
        the same inputs always give the same decision (timings aside)."""
        ctx = Context(snapshot, request, self.cost_model, Stage.DECODE)
        candidates = [Candidate(ctx, r, r, None, r.name) for r in snapshot.regions if r.can_decode]
        if not candidates:
            explanation = Explanation([], "no region in the snapshot can decode")
            raise rejection(RejectReason.NO_ELIGIBLE_REGION, explanation.verdict, explanation)
        timings: dict[str, float] = {}
        filtered = _filter(self.decode, ctx, candidates, timings)
        ranked = _rank(self.decode, ctx, filtered.survivors, timings) if filtered.survivors else _Ranked([], {}, {})
        stages = [
            StageTrace(
                Stage.DECODE,
                None,
                len(candidates),
                filtered.cut,
                ranked.scores,
                ranked.totals,
                [c.label for c in ranked.ranking],
                timings_us=timings,
            )
        ]
        if filtered.emptied_by is not None:
            verdict = f"no decode region: filter {filtered.emptied_by_name!r} cut the last of {len(candidates)}"
            raise rejection(filtered.emptied_by, verdict, Explanation(stages, verdict))
        failures: list[tuple[RejectReason, str]] = []
        for decode in ranked.ranking[: self.max_decode_regions_tried]:
            decision = self._place_on(ctx.for_prefill(decode.region), stages, failures)
            if decision is not None:
                return decision
        reason, why = failures[0]
        verdict = f"no placement on the {len(failures)} best decode regions; first: {why}"
        raise rejection(reason, verdict, Explanation(stages, verdict))

    def _place_on(
        self, ctx: Context, stages: list[StageTrace], failures: list[tuple[RejectReason, str]]
    ) -> Decision | None:
        decode = ctx.decode
        assert decode is not None
        snapshot = ctx.snapshot
        local = Candidate(ctx, decode, decode, None, f"{decode.name} (local)")
        candidates = [local]
        uncached = ctx.uncached(decode)
        threshold = self.rule.min_uncached_tokens
        if uncached >= threshold:
            by_name = snapshot.regions_by_name()
            for link in snapshot.links_into(decode.name):
                source = by_name[link.src]
                if source.can_serve_split_prefill and source.ships_kv_to(decode):
                    candidates.append(Candidate(ctx, source, decode, link, source.name))
            note = f"uncached {uncached} >= {threshold}: {len(candidates) - 1} split candidates"
        elif threshold >= DisaggregationRule.NEVER:
            note = "local asked: split not considered"
        else:
            note = f"uncached {uncached} < {threshold}: split not considered"
        timings: dict[str, float] = {}
        filtered = _filter(self.prefill, ctx, candidates, timings)
        local_ok = bool(filtered.survivors) and filtered.survivors[0] is local
        splits = filtered.survivors[1:] if local_ok else filtered.survivors
        ranked = _rank(self.prefill, ctx, splits, timings) if splits else _Ranked([], {}, {})
        best_split = ranked.ranking[0] if ranked.ranking else None
        chosen, verdict = self._verdict(local, local_ok, best_split, filtered, note)
        stages.append(
            StageTrace(
                Stage.PREFILL,
                decode.name,
                len(candidates),
                filtered.cut,
                ranked.scores,
                ranked.totals,
                [c.label for c in ranked.ranking],
                note,
                timings,
            )
        )
        if chosen is None:
            assert filtered.emptied_by is not None
            failures.append((filtered.emptied_by, f"{decode.name}: {verdict}"))
            return None
        return _decision(chosen, local, Explanation(list(stages), verdict))

    def _verdict(
        self, local: Candidate, local_ok: bool, best_split: Candidate | None, filtered: _Filtered, note: str
    ) -> tuple[Candidate | None, str]:
        if best_split is None:
            if local_ok:
                return local, f"local: {note}; no split candidate survived the filters"
            return None, f"nothing fits ({note}): filter {filtered.emptied_by_name!r} cut the last candidate"
        split = best_split.estimate
        if not local_ok:
            cutter = next(name for name, labels in filtered.cut.items() if local.label in labels)
            return best_split, f"split via {best_split.label}: local was cut by filter {cutter!r}"
        here = local.estimate
        cost_gain = gain(split.total_usd, here.total_usd)
        ttft_gain = gain(split.ttft_s, here.ttft_s)
        cheaper, faster = _percent(cost_gain, "cheaper", "dearer"), _percent(ttft_gain, "faster", "slower")
        figures = (
            f"${split.total_usd:.6f} vs ${here.total_usd:.6f} local ({cheaper}), "
            f"TTFT {split.ttft_s * 1000:.0f} ms vs {here.ttft_s * 1000:.0f} ms local ({faster})"
        )
        if cost_gain >= self.rule.min_cost_gain or ttft_gain >= self.rule.min_ttft_gain:
            return best_split, f"split via {best_split.label}: {figures}"
        margins = f"split needs {self.rule.min_cost_gain:.0%} cheaper or {self.rule.min_ttft_gain:.0%} faster"
        return local, f"local: split via {best_split.label} would be {figures}; {margins}"


def gain(split: float, local: float) -> float:
    """How much less the split's figure (dollars, TTFT) is than local's, as a fraction of local's. Local at 0
    (a region priced $0): 0 when the split is 0 too, else -inf, worse than any margin (a 0 here let a dearer,
    slower split pass `min_cost_gain: 0`)."""
    if local > 0:
        return 1.0 - split / local
    return 0.0 if split <= 0 else -math.inf


def _percent(fraction: float, better: str, worse: str) -> str:
    """`+49.0% cheaper`, `34.6% slower` (not `-34.6% faster`)."""
    if not math.isfinite(fraction):
        return f"not {better}: local's is 0"
    return f"{fraction:+.1%} {better}" if fraction >= 0 else f"{-fraction:.1%} {worse}"


def _decision(chosen: Candidate, local: Candidate, explanation: Explanation) -> Decision:
    estimate = chosen.estimate
    plan = estimate.transfer
    region: Region = chosen.region
    return Decision(
        mode=Mode.LOCAL if plan is None else Mode.SPLIT,
        decode_region=chosen.decode.name,
        prefill_region=region.name,
        codec=None if plan is None else plan.codec,
        num_streams=0 if plan is None else plan.num_streams,
        uncached_tokens=estimate.uncached_tokens,
        kv_bytes_raw=0 if plan is None else plan.raw_bytes,
        kv_bytes_wire=0 if plan is None else plan.wire_bytes,
        predicted_ttft_ms=estimate.ttft_s * 1000.0,
        predicted_tpot_ms=estimate.tpot_s * 1000.0,
        predicted_queue_wait_ms=estimate.queue_wait_s * 1000.0,
        predicted_transfer_ms=0.0 if plan is None else plan.exposed_s * 1000.0,
        cost=Cost.of(estimate),
        colocated_cost=Cost.of(local.estimate),
        explanation=explanation,
    )
