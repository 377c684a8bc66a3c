"""What a job costs: the prices it is billed at (`PriceTable`), what the control plane knows of the finished
job (`JobUsage`) and the arithmetic that turns the two into its ledger row (`entry_values`). Pure; no I/O.

    prefill $   = prefill GPU-s / 3600 x the prefill region's $/GPU-hour
    decode $    = decode GPU-s / 3600 x the decode region's $/GPU-hour
    egress $    = wire bytes / 1e9 x the (prefill -> decode) link's $/GB (0 when colocated)
    colocated $ = (colocated prefill GPU-s + decode GPU-s) / 3600 x the decode region's $/GPU-hour
    savings $   = colocated $ - (prefill $ + decode $ + egress $)

The prices are stored beside the costs, so any sum can be recomputed."""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

S_PER_HOUR = 3600.0
BYTES_PER_GB = 1e9


@dataclass(frozen=True)
class PriceTable:
    """$/GPU-hour per region and $/GB per directed (src, dst) link; what a job is billed at."""

    gpu_hour_usd: Mapping[str, float]
    egress_usd_per_gb: Mapping[tuple[str, str], float] = field(default_factory=dict)

    def gpu_hour(self, region: str) -> float:
        try:
            return float(self.gpu_hour_usd[region])
        except KeyError:
            raise KeyError(f"no $/GPU-hour for region {region!r}") from None

    def egress(self, src: str, dst: str) -> float:
        if src == dst:
            return 0.0
        try:
            return float(self.egress_usd_per_gb[(src, dst)])
        except KeyError:
            raise KeyError(f"no egress $/GB for link {src!r} -> {dst!r}") from None


@dataclass(frozen=True)
class JobUsage:
    """What the control plane knows of a finished job (from its record in the job store). Every field is a
    ledger column of the same name."""

    job_id: str
    tenant: str
    model: str
    prefill_region: str
    decode_region: str
    prefill_gpu_s: float
    decode_gpu_s: float
    tokens_in: int
    tokens_out: int
    kv_bytes_raw: int = 0
    kv_bytes_wire: int = 0
    finished_at: dt.datetime | None = None  # None: now
    colocated_prefill_gpu_s: float | None = None  # prefill GPU-s had it run in the decode region; None: same
    placement: str = ""  # "local" or "split"
    attempts: int = 1  # the attempt that answered
    ttft_s: float | None = None  # job created -> first token reached the control plane
    tpot_s: float | None = None  # mean s per output token after the first
    codec: str = ""  # the KV codec of its shipment ("" when local)


def utc_naive(t: dt.datetime | None) -> dt.datetime:
    """`t` (None: now) in UTC without its tzinfo, as the ledger stores times."""
    if t is None:
        return dt.datetime.now(dt.UTC).replace(tzinfo=None)
    if t.tzinfo is not None:
        t = t.astimezone(dt.UTC).replace(tzinfo=None)
    return t


def gpu_usd(gpu_s: float, usd_per_gpu_hour: float) -> float:
    return gpu_s / S_PER_HOUR * usd_per_gpu_hour


def entry_values(usage: JobUsage, prices: PriceTable) -> dict[str, Any]:
    """The ledger row of a job: its GPU-seconds and bytes, the prices given and the costs computed from them."""
    p_price = prices.gpu_hour(usage.prefill_region)
    d_price = prices.gpu_hour(usage.decode_region)
    e_price = prices.egress(usage.prefill_region, usage.decode_region)
    colo_prefill_s = usage.prefill_gpu_s if usage.colocated_prefill_gpu_s is None else usage.colocated_prefill_gpu_s
    prefill_usd = gpu_usd(usage.prefill_gpu_s, p_price)
    decode_usd = gpu_usd(usage.decode_gpu_s, d_price)
    egress_usd = usage.kv_bytes_wire / BYTES_PER_GB * e_price
    total = prefill_usd + decode_usd + egress_usd
    colocated = gpu_usd(colo_prefill_s + usage.decode_gpu_s, d_price)
    priced = {"prefill_usd_per_gpu_h": p_price, "decode_usd_per_gpu_h": d_price, "egress_usd_per_gb": e_price}
    costs = {"prefill_usd": prefill_usd, "decode_usd": decode_usd, "egress_usd": egress_usd, "total_usd": total}
    return (
        dataclasses.asdict(usage)
        | {"finished_at": utc_naive(usage.finished_at), "colocated_prefill_gpu_s": colo_prefill_s}
        | priced
        | costs
        | {"colocated_usd": colocated, "savings_usd": colocated - total}
    )
