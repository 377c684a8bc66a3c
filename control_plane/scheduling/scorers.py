"""Built-in scorers and the built-in picker. Scorers return one value per candidate, meant
for [0, 1], higher is better; the framework clamps and weights them. Cost-like figures are
scored relative to the best candidate (best / value: the cheapest scores 1, one twice as dear
0.5), so a weight means the same whatever the currency or scale. Formulas and YAML:
docs/scheduler.md, "Plugins"."""

from __future__ import annotations

import math
from collections.abc import Sequence

import xxhash
from pydantic import BaseModel, ConfigDict, Field

from prfaas.control_plane.scheduling.plugins import Candidate, Context, Stage


class _Plugin(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


def relative_to_best(values: Sequence[float]) -> list[float]:
    """best / value for costs (lower is better): 1 for the lowest, 0 for infinite or NaN ones (whatever
    their place in `values`)."""
    best = min((v for v in values if not math.isnan(v)), default=0.0)
    out: list[float] = []
    for value in values:
        if math.isnan(value) or math.isinf(value):
            out.append(0.0)
        elif value <= best:
            out.append(1.0)
        else:
            out.append(best / value)
    return out


class PriceScorer(_Plugin):
    """`price`: GPU dollars. Decode stage: the request's decode $ in each region; prefill
    stage: prefill $ + decode $ of the placement (spot price for split prefill when the
    region has one and the policy allows it)."""

    def score(self, ctx: Context, candidates: Sequence[Candidate]) -> list[float]:
        if ctx.stage is Stage.DECODE:
            decode_usd = ctx.cost_model.decode_usd
            return relative_to_best([decode_usd(ctx.request, c.region) for c in candidates])
        return relative_to_best([c.estimate.prefill_usd + c.estimate.decode_usd for c in candidates])


class EgressCostScorer(_Plugin):
    """`egress-cost`: $ of the KV's wire bytes leaving the prefill region (0 for local)."""

    def score(self, ctx: Context, candidates: Sequence[Candidate]) -> list[float]:
        return relative_to_best([c.estimate.egress_usd for c in candidates])


class QueueDepthScorer(_Plugin):
    """`queue-depth`: 1 / (1 + queue wait / half_score_wait_s); the predicted wait for a
    prefill worker in the candidate region (0 s scores 1, half_score_wait_s scores 0.5)."""

    half_score_wait_s: float = Field(default=1.0, gt=0, allow_inf_nan=False)

    def score(self, ctx: Context, candidates: Sequence[Candidate]) -> list[float]:
        priority = ctx.request.priority
        wait = ctx.cost_model.queue_wait_s
        return [1.0 / (1.0 + wait(c.region, priority) / self.half_score_wait_s) for c in candidates]


class PrefixCacheScorer(_Plugin):
    """`prefix-cache`: share of the prompt already in the candidate region's prefix cache."""

    def score(self, ctx: Context, candidates: Sequence[Candidate]) -> list[float]:
        prompt = ctx.request.prompt_tokens
        return [1.0 - ctx.uncached(c.region) / prompt for c in candidates]


class DecodeHeadroomScorer(_Plugin):
    """`decode-headroom`: the share of the candidate's KV buffer left after this request's
    reservation, (free - needed) / whole (1 when the region does not report its whole buffer).
    Spreads decode over regions by what they can still take."""

    def score(self, ctx: Context, candidates: Sequence[Candidate]) -> list[float]:
        scores = []
        for c in candidates:
            whole, needed = c.region.kv_buffer_bytes, ctx.kv_bytes_needed(c.region)
            scores.append(1.0 if not whole else max(0.0, c.region.kv_buffer_free_bytes - needed) / whole)
        return scores


class LinkHeadroomScorer(_Plugin):
    """`link-headroom`: 1 - utilization of the candidate's link (1 for local)."""

    def score(self, ctx: Context, candidates: Sequence[Candidate]) -> list[float]:
        return [1.0 if c.link is None else 1.0 - c.link.utilization for c in candidates]


class LatencyScorer(_Plugin):
    """`latency`: predicted TTFT (prefill stage) or TPOT (decode stage), relative to the best."""

    def score(self, ctx: Context, candidates: Sequence[Candidate]) -> list[float]:
        if ctx.stage is Stage.DECODE:
            return relative_to_best([c.region.tpot_ms for c in candidates])
        return relative_to_best([c.estimate.ttft_s for c in candidates])


class MaxScorePicker(_Plugin):
    """`max-score`: highest total first. Totals within `tie_band` (a share of the best total)
    of the best count as equal; equal candidates are ordered by a hash of (request id, label),
    so the same snapshot and request always give the same order while equal regions share a
    burst of requests (between two heartbeats every request sees the same snapshot: a fixed
    tie order would send the whole burst to one region). Requests without an id, and the
    rest of the order, go by total, then label."""

    tie_band: float = Field(default=0.0, ge=0, le=1, allow_inf_nan=False)

    def rank(self, ctx: Context, candidates: Sequence[Candidate], totals: Sequence[float]) -> list[Candidate]:
        best = max(totals, default=0.0)
        floor = best - self.tie_band * abs(best)
        request_id = ctx.request.request_id

        def key(i: int) -> tuple[int, float, int, str]:
            label = candidates[i].label
            if totals[i] >= floor and request_id:
                return 0, 0.0, xxhash.xxh3_64_intdigest(f"{request_id}/{label}".encode()), label
            return 1, -totals[i], 0, label

        return [candidates[i] for i in sorted(range(len(candidates)), key=key)]
