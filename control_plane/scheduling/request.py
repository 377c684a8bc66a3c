"""`Request`: what the scheduler knows about one tenant request when it places it."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

from prfaas.control_plane.scheduling.snapshot import Region


class Priority(StrEnum):
    """`high` requests are served ahead of queued work (the queue-wait estimate ignores the
    queue); `normal` and `low` wait their turn."""

    LOW = "low"
    NORMAL = "normal"
    HIGH = "high"


class Slo(BaseModel):
    """Latency objectives: time to first token and time per output token."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    ttft_ms: float = Field(gt=0, allow_inf_nan=False)
    tpot_ms: float = Field(gt=0, allow_inf_nan=False)


class Request(BaseModel):
    """One request, tokenized. `uncached_tokens` (per region, from the control plane's own
    lookup) wins over `prefix_block_hashes`; without either a region is cold for it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    request_id: str = ""
    tenant: str = Field(min_length=1)
    prompt_tokens: int = Field(ge=1)
    max_new_tokens: int = Field(ge=1)
    slo: Slo
    uncached_tokens: dict[str, Annotated[int, Field(ge=0)]] = Field(
        default_factory=dict, description="region name -> prompt tokens not in that region's prefix cache"
    )
    prefix_block_hashes: tuple[str, ...] = Field(
        default=(), description="chained hash of each full prompt block, first block first"
    )
    block_tokens: int = Field(default=16, ge=1, description="tokens per hashed block")
    allowed_regions: frozenset[str] | None = Field(
        default=None, description="residency: the only regions that may see this request; None: any"
    )
    priority: Priority = Priority.NORMAL
    allow_lossy_codec: bool = Field(default=False, description="may the KV cross the WAN in a lossy codec (int8, fp8)")
    lossy_codec: str | None = Field(
        default=None, min_length=1, description="with allow_lossy_codec: the one lossy codec consented to; None: any"
    )

    @model_validator(mode="after")
    def _within_prompt(self) -> Self:
        for name, count in self.uncached_tokens.items():
            if count > self.prompt_tokens:
                raise ValueError(f"uncached_tokens[{name!r}] = {count} exceeds prompt_tokens = {self.prompt_tokens}")
        hashed = len(self.prefix_block_hashes) * self.block_tokens
        if hashed > self.prompt_tokens:
            raise ValueError(f"prefix_block_hashes cover {hashed} tokens > prompt_tokens ({self.prompt_tokens})")
        return self

    def allows(self, region_name: str) -> bool:
        return self.allowed_regions is None or region_name in self.allowed_regions

    def uncached_in(self, region: Region) -> int:
        """Prompt tokens `region` would have to prefill.

        From the hints, the cached prefix is the longest run of leading block hashes found in
        the region's cache. Hashes are chained (each covers its whole prefix), so a cache keeps
        a block only while it keeps the blocks before it: the matches form a prefix, found here
        by binary search (O(log blocks) set lookups per region).
        """
        explicit = self.uncached_tokens.get(region.name)
        if explicit is not None:
            return explicit
        cached_set = region.cached_prefix_hashes
        # a region reuses the blocks before the prompt's last token only (it computes that token's logits):
        # a prompt of k whole blocks reuses k - 1 of them, as the engine's lookup and the decode pin do
        hashes = self.prefix_block_hashes[: max(0, self.prompt_tokens - 1) // max(1, self.block_tokens)]
        if not cached_set or not hashes:
            return self.prompt_tokens
        lo, hi = 0, len(hashes)  # invariant: hashes[:lo] cached, hashes[hi:] not
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if hashes[mid - 1] in cached_set:
                lo = mid
            else:
                hi = mid - 1
        return self.prompt_tokens - lo * self.block_tokens
