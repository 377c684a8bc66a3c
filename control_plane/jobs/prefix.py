"""A job's prompt blocks, as hit-aware placement and the regions see them (engine/blocks.py).

At admission the API hashes the tokenized prompt once: the job records its cache salt (the
prefix cache scope, `Settings.prefix`) and the short digests of its full blocks, first block
first. The scheduler reads the digests (`Request.prefix_block_hashes`) against what each
region publishes; every call to a region carries the salt, so the region reuses and keeps
blocks under the same scope. A job without a salt (scope `off`, or a record from before)
touches no region's prefix cache.

Two placements place with the same policy but without this (the bench's baselines):
- `auto-prefix-blind`: as if there were no prefix caches: the scheduler sees no residency and
  the regions neither reuse nor keep the job's blocks (every prompt token is computed).
- `auto-residency-blind`: the scheduler and the instance pick ignore where prefixes are cached
  and nothing is pinned, but a region that happens to hold a prefix still reuses it: what
  hit-aware placement adds beyond the caches themselves.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from prfaas.control_plane.settings import Settings
from prfaas.engine.blocks import block_hashes, short

PREFIX_BLIND = "auto-prefix-blind"  # no prefix cache at all for the job
RESIDENCY_BLIND = "auto-residency-blind"  # placement ignores residency; regions still reuse what they hold
BLIND = (PREFIX_BLIND, RESIDENCY_BLIND)


def prefix_fields(
    token_ids: Sequence[int], tenant_id: str, settings: Settings, request_salt: str | None = None
) -> dict[str, str]:
    """The job fields that name its prompt blocks: `cache_salt` and `prefix` (comma-separated short digests).
    `request_salt` (the request's `cache_salt`, as vLLM's) narrows the scope to the requests that carry it."""
    scope = settings.prefix.scope
    if scope == "off":
        return {}
    salt = tenant_id if scope == "tenant" else ""
    if request_salt:
        salt += "\x00" + request_salt
    digests = block_hashes(token_ids, settings.prefix.block_tokens, salt)
    return {"cache_salt": salt, "prefix": ",".join(short(d) for d in digests)}


def cache_salt(job: Mapping[str, str]) -> str | None:
    """The salt a region reuses and keeps the job's blocks under; None: the job uses no prefix cache."""
    if job.get("placement_asked") == PREFIX_BLIND:
        return None
    return job.get("cache_salt")


def prefix_hashes(job: Mapping[str, str]) -> tuple[str, ...]:
    """The short digests the scheduler matches against regions' caches (none for a blind placement)."""
    raw = job.get("prefix")
    if not raw or job.get("placement_asked") in BLIND:
        return ()
    return tuple(raw.split(","))


def pins(job: Mapping[str, str]) -> bool:
    """Whether dispatch asks the decode region to pin the prefix it holds (and ships only the rest)."""
    return cache_salt(job) is not None and job.get("placement_asked") not in BLIND
