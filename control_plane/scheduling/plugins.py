"""The plugin contracts of the filter -> score -> pick framework (llm-d's shape).

A decision runs two profiles. The *decode* profile chooses the decode region among the
regions that can decode; each candidate is "the request runs on this region". The *prefill*
profile then chooses, for one decode region D, between D prefilling itself (the local
candidate) and each region with a link into D (the split candidates). A plugin sees the
stage in `ctx.stage` and the region being judged in `candidate.region`.

Plugins are pure: they read the snapshot, the request and the cost model's estimate, and
return a bool (filters) or numbers (scorers). The framework, not the plugin, clamps scores
to [0, 1], weights, sums, times and records them.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum
from typing import Protocol

from prfaas.control_plane.scheduling.costmodel import CostModel, Estimate
from prfaas.control_plane.scheduling.errors import RejectReason
from prfaas.control_plane.scheduling.request import Request
from prfaas.control_plane.scheduling.snapshot import ClusterSnapshot, Link, Region


class Stage(StrEnum):
    DECODE = "decode"
    PREFILL = "prefill"


class Context:
    """One decision's inputs plus figures memoized for all plugins of all stages."""

    __slots__ = ("_uncached", "cost_model", "decode", "request", "snapshot", "stage")

    def __init__(
        self,
        snapshot: ClusterSnapshot,
        request: Request,
        cost_model: CostModel,
        stage: Stage,
        decode: Region | None = None,
        uncached: dict[str, int] | None = None,
    ) -> None:
        self.snapshot = snapshot
        self.request = request
        self.cost_model = cost_model
        self.stage = stage
        self.decode = decode  # the chosen decode region in the prefill stage
        self._uncached = {} if uncached is None else uncached

    def for_prefill(self, decode: Region) -> Context:
        """The context of the prefill stage for `decode`, sharing the memo."""
        return Context(self.snapshot, self.request, self.cost_model, Stage.PREFILL, decode, self._uncached)

    def uncached(self, region: Region) -> int:
        """Prompt tokens `region` would prefill (its prefix cache considered)."""
        count = self._uncached.get(region.name)
        if count is None:
            count = self._uncached[region.name] = self.request.uncached_in(region)
        return count

    def kv_bytes_needed(self, region: Region) -> int:
        """KV buffer `region` reserves to decode the request: prompt plus generated tokens, in its dtype, plus
        the model's per-request recurrent state (a hybrid model's)."""
        tokens = self.request.prompt_tokens + self.request.max_new_tokens
        model = self.snapshot.model
        return tokens * model.kv_bytes_at(region.kv_dtype) + model.kv_state_bytes


class Candidate:
    """A placement under judgement. `region` is the region this stage chooses: the decode
    region in the decode stage, the region that prefills in the prefill stage. `link` is None
    for a local placement (the decode region prefills)."""

    __slots__ = ("_estimate", "ctx", "decode", "label", "link", "region")

    def __init__(self, ctx: Context, region: Region, decode: Region, link: Link | None, label: str) -> None:
        self.ctx = ctx
        self.region = region
        self.decode = decode
        self.link = link
        self.label = label
        self._estimate: Estimate | None = None

    @property
    def is_local(self) -> bool:
        return self.link is None

    @property
    def ttft_floor_s(self) -> float:
        """Queue wait plus prefill in the prefilling region: TTFT without any transfer, a lower
        bound of `estimate.ttft_s` that is cheap to compute (filters test it first)."""
        if self._estimate is not None:
            return self._estimate.queue_wait_s + self._estimate.prefill_s
        ctx = self.ctx
        region = self.region
        wait_s = ctx.cost_model.queue_wait_s(region, ctx.request.priority)
        return wait_s + ctx.uncached(region) / region.prefill_tokens_per_s

    @property
    def estimate(self) -> Estimate:
        """Predicted latency and cost, computed once on first use."""
        if self._estimate is None:
            ctx = self.ctx
            if self.link is None:
                self._estimate = ctx.cost_model.local(ctx.request, self.decode, ctx.uncached(self.decode))
            else:
                self._estimate = ctx.cost_model.split(
                    ctx.request,
                    ctx.snapshot.model,
                    self.region,
                    self.decode,
                    self.link,
                    ctx.uncached(self.region),
                    ctx.uncached(self.decode),
                )
        return self._estimate


class Filter(Protocol):
    """Keeps or cuts one candidate. `reason` is what a rejection says when this filter cut the
    last candidates."""

    @property
    def reason(self) -> RejectReason: ...

    def keep(self, ctx: Context, candidate: Candidate) -> bool: ...


class Scorer(Protocol):
    """Scores every surviving candidate; one number each, meant to lie in [0, 1] (higher is
    better). Given the whole list so it can normalize against the best candidate."""

    def score(self, ctx: Context, candidates: Sequence[Candidate]) -> Sequence[float]: ...


class Picker(Protocol):
    """Orders the scored candidates, best first. Must be deterministic."""

    def rank(self, ctx: Context, candidates: Sequence[Candidate], totals: Sequence[float]) -> list[Candidate]: ...
