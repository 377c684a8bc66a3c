"""`Decision`: the scheduler's answer, and `Explanation`: why.

Plain frozen dataclasses (cheap to build on the hot path); `decision_json` renders them with
pydantic for `prfaas sched explain` and logs. Timings are left out of equality, so two runs on
the same snapshot and request compare equal.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from pydantic import TypeAdapter

from prfaas.control_plane.scheduling.costmodel import Estimate
from prfaas.control_plane.scheduling.plugins import Stage


class Mode(StrEnum):
    LOCAL = "local"  # the decode region prefills and decodes
    SPLIT = "split"  # a prefill region prefills and ships the KV to the decode region


@dataclass(frozen=True)
class Cost:
    """Predicted dollars of one request."""

    prefill_usd: float
    decode_usd: float
    egress_usd: float
    total_usd: float

    @classmethod
    def of(cls, estimate: Estimate) -> Cost:
        return cls(estimate.prefill_usd, estimate.decode_usd, estimate.egress_usd, estimate.total_usd)


@dataclass(frozen=True)
class StageTrace:
    """One profile run: who each filter cut, each survivor's weighted scores and total, the
    picker's order, and each plugin's wall time (µs)."""

    stage: Stage
    decode_region: str | None  # the decode region the prefill stage chose for; None in the decode stage
    num_candidates: int
    cut: dict[str, list[str]]  # filter name -> labels it cut, in filter order
    scores: dict[str, dict[str, float]]  # label -> scorer name -> weight * clamped score
    totals: dict[str, float]  # label -> sum of weighted scores
    ranking: list[str]  # labels, best first
    note: str = ""
    timings_us: dict[str, float] = field(default_factory=dict, compare=False)


@dataclass(frozen=True)
class Explanation:
    stages: list[StageTrace]
    verdict: str  # the disaggregation rule's reasoning, or why nothing fit


@dataclass(frozen=True)
class Decision:
    """Where and how one request runs. For `local`, `prefill_region` equals `decode_region`,
    `codec` is None and `num_streams` 0."""

    mode: Mode
    decode_region: str
    prefill_region: str
    codec: str | None
    num_streams: int
    uncached_tokens: int  # tokens the prefilling region computes
    kv_bytes_raw: int  # KV shipped, as decoded (0 for local)
    kv_bytes_wire: int  # the same on the wire, after the codec
    predicted_ttft_ms: float
    predicted_tpot_ms: float
    predicted_queue_wait_ms: float
    predicted_transfer_ms: float  # transfer time not hidden behind prefill (0 for local)
    cost: Cost
    colocated_cost: Cost  # the same request run local on the decode region
    explanation: Explanation


_DECISION = TypeAdapter(Decision)
_EXPLANATION = TypeAdapter(Explanation)


def decision_dict(decision: Decision) -> dict[str, Any]:
    """JSON-ready mapping of every `Decision` field (infinite predictions become null)."""
    cleaned: dict[str, Any] = _clean(_DECISION.dump_python(decision, mode="json"))
    return cleaned


def explanation_dict(explanation: Explanation) -> dict[str, Any]:
    cleaned: dict[str, Any] = _clean(_EXPLANATION.dump_python(explanation, mode="json"))
    return cleaned


def decision_json(decision: Decision) -> str:
    return json.dumps(decision_dict(decision), indent=2)


def _clean(value: Any) -> Any:
    # pydantic renders inf as "Infinity" strings in some modes; JSON has no infinity: use null.
    if isinstance(value, float) and (value != value or value in (float("inf"), float("-inf"))):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value
