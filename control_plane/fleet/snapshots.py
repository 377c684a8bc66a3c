"""The fleet as the scheduler sees it: registry records (fleet/records.py) and links in, a
`ClusterSnapshot` out. Pure: the registry reads Redis, prices come from billing's PriceBook.

A region is summed over its healthy instances (RegionRecord.of): its queues, workers and KV
buffer added up, its rates the mean of those measured. A decode reservation lands on one
instance, so the snapshot also carries the largest free buffer of one
(`kv_buffer_largest_free_bytes`, what the `capacity` filter checks), and how often the region
beats (`heartbeat_interval_s`, what the `health` filter ages it by).
"""

from __future__ import annotations

import logging
import time
from typing import cast

from pydantic import ValidationError

from prfaas.control_plane.billing.prices import PriceBook
from prfaas.control_plane.fleet.records import RegionRecord
from prfaas.control_plane.scheduling.snapshot import ClusterSnapshot, KVDtype, Link, ModelShape, Region, Role

log = logging.getLogger(__name__)

FALLBACK_PREFILL_TPS = 2000.0  # tokens/s assumed until a region measures its own
FALLBACK_DECODE_TPS = 50.0


def snapshot_of(
    records: list[RegionRecord],
    links: list[Link],
    model: ModelShape,
    prices: PriceBook,
    exclude: frozenset[str] = frozenset(),
) -> ClusterSnapshot:
    """`exclude`: regions by name, or instances by `region/instance` key or incarnation
    (`InstanceRecord.excluded_by`; a region is left out, `excluded`, once none of its healthy
    instances is left). A region whose figures do not validate is left out (logged), and the
    links naming it."""
    priors = _rate_priors(records)
    regions = []
    for r in records:
        try:
            regions.append(_region(r, exclude, prices, priors.get(r.gpu_type, {})))
        except ValidationError as exc:  # one region's odd figures never stop placement in the others
            log.warning("region %s left out of the snapshot: %s", r.name, exc)
    names = {r.name for r in regions}
    kept = tuple(link for link in links if link.src in names and link.dst in names)
    return ClusterSnapshot(taken_at_s=time.time(), model=model, regions=tuple(regions), links=kept)


def _region(r: RegionRecord, exclude: frozenset[str], prices: PriceBook, prior: dict[str, float]) -> Region:
    left = [i for i in r.healthy_instances if not i.excluded_by(exclude)]
    # a region alive but whose healthy instances all failed this job (or left out by name) is `excluded`: the
    # scheduler says so, not that it is unhealthy (a restarted instance registers again and is no longer)
    excluded = r.name in exclude or (r.healthy and not left)
    if left and len(left) < len(r.healthy_instances):  # capacity, load and cache of what a retry may use
        r = RegionRecord.of([i for i in r.instances if not i.excluded_by(exclude)])
    decode_tps = r.decode_tokens_per_s or prior.get("decode_tokens_per_s") or FALLBACK_DECODE_TPS
    prefill_tps = r.prefill_tokens_per_s or prior.get("prefill_tokens_per_s") or FALLBACK_PREFILL_TPS
    on_demand = prices.on_demand(r.name)
    workers = max(1, r.num_workers)
    decodes = r.role != "prefill"
    return Region(
        name=r.name, role=Role(r.role), gpu_type=r.gpu_type, num_gpus=workers, num_workers=workers,
        usd_per_gpu_hour=r.usd_per_gpu_hour if on_demand is None else on_demand,
        spot_usd_per_gpu_hour=prices.spot(r.name), queue_depth=r.queue_depth,
        num_busy_workers=min(r.busy_workers, workers),
        kv_buffer_free_bytes=r.kv_free_bytes if decodes else 0,
        kv_buffer_largest_free_bytes=r.kv_largest_free_bytes if decodes else 0,
        kv_buffer_bytes=r.kv_used_bytes + r.kv_free_bytes if decodes else 0,
        prefill_tokens_per_s=prefill_tps, decode_tokens_per_s=decode_tps,
        tpot_ms=1000.0 / decode_tps, healthy=bool(left) and r.name not in exclude, excluded=excluded,
        heartbeat_age_s=r.heartbeat_age_s, heartbeat_interval_s=r.heartbeat_interval_s or None,
        cached_prefix_hashes=r.prefix_blocks,
        # a decode region reports its queue in jobs (each holds a worker for its whole generation), not tokens
        queued_prefill_tokens=None if r.role == "decode" else r.queued_prefill_tokens,
        running_prefill_tokens=r.running_prefill_tokens, mean_prefill_s=r.mean_job_s,
        queue_capacity=r.queue_limit or None,  # its instances' together
        decode_running=r.decode_running, decode_slots=r.decode_slots,
        kv_dtype=cast(KVDtype | None, r.kv_dtype or None),  # checked at registration
    )  # fmt: skip


def _rate_priors(records: list[RegionRecord]) -> dict[str, dict[str, float]]:
    """Per GPU type, the mean rates the regions that measured them report: what a region that
    has run no job yet is assumed to reach. A fixed low fallback would make it look slower and
    dearer than every measured region, so it would never get the job that measures it."""
    sums: dict[str, dict[str, list[float]]] = {}
    for r in records:
        for field in ("prefill_tokens_per_s", "decode_tokens_per_s"):
            if getattr(r, field):
                sums.setdefault(r.gpu_type, {}).setdefault(field, []).append(getattr(r, field))
    return {gpu: {field: sum(v) / len(v) for field, v in fields.items()} for gpu, fields in sums.items()}
