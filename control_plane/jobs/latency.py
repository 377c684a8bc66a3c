"""Where a finished job's time went: its stages, from its record and timeline, and the control plane's
latency histograms over them (`GET /metrics` of the API process, which answers the admin key or
`metrics_token` only: the tenant label names tenants; docs/operations.md, "Metrics"). The
API observes admission itself (`prfaas_api_admission_seconds`, api/metrics.py).

`stage_seconds(job, timeline)` is pure: the answering attempt's stages, in seconds, each present only
when the job went through it:

    queue         the attempt queued -> its work began (PREFILLING or LOCAL; placement and Reserve included)
    placement     the scheduler's decision (the dispatcher's, or the API's for a job placed at admission)
    reserve       the Reserve call to the decode region (split)
    prefill       PREFILLING -> TRANSFERRING (split); LOCAL -> first token (local)
    transfer      TRANSFERRING -> DECODING: the KV's tail after the prefill, and the hand-off (split)
    first_token   job created -> first token at the control plane (TTFT)
    tpot          mean seconds per output token after the first
    e2e           job created -> DONE

`LatencyMetrics.observe` is called once per job, by the process that wrote its ledger entry
(billing/meter.py): off the request path, and no job counted twice across API processes. Labels are
bounded: placement (local, split), regions and links (the fleet's), codec (the policy's) and tenant, which
keeps its first `TENANT_LABELS` distinct ids per process and folds the rest into "other".
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram

TENANT_LABELS = 50  # distinct tenant label values per process; later tenants are "other"
# 1 ms .. 10 min: a placement takes microseconds to milliseconds, a 128K-token prefill minutes
BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
TPOT_BUCKETS_S = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)


def _f(job: Mapping[str, Any], name: str) -> float | None:
    value = job.get(name)
    return None if value is None or value == "" else float(value)


def stage_seconds(
    job: Mapping[str, Any], timeline: list[dict[str, Any]], tpot_s: float | None = None
) -> dict[str, float]:
    """The answering attempt's stages (module docstring), in seconds; `tpot_s` as metering derived it."""
    attempt = int(job["attempt"])
    at = {str(e["state"]): float(e["at"]) for e in timeline if int(e.get("attempt", 0)) == attempt}
    created = float(job["created_at"])
    first = _f(job, "first_token_at")
    out: dict[str, float] = {}
    began = at.get("PREFILLING", at.get("LOCAL"))
    if began is not None:
        out["queue"] = began - at.get("QUEUED", created)
    for stage, field in (("placement", "placement_s"), ("reserve", "reserve_s")):
        if (value := _f(job, field)) is not None:
            out[stage] = value
    if "PREFILLING" in at and "TRANSFERRING" in at:
        out["prefill"] = at["TRANSFERRING"] - at["PREFILLING"]
    elif "LOCAL" in at and first is not None:
        out["prefill"] = first - at["LOCAL"]
    if "TRANSFERRING" in at and "DECODING" in at:
        out["transfer"] = at["DECODING"] - at["TRANSFERRING"]
    if first is not None:
        out["first_token"] = first - created
    if tpot_s is not None:
        out["tpot"] = tpot_s
    if "DONE" in at:
        out["e2e"] = at["DONE"] - created
    return {stage: max(0.0, seconds) for stage, seconds in out.items()}


class BoundedLabel:
    """The first `limit` distinct values keep their name; the rest are "other" (a label set that stays bounded)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, value: str) -> str:
        with self._lock:
            if value in self._seen:
                return value
            if len(self._seen) < self.limit:
                self._seen.add(value)
                return value
        return "other"


class LatencyMetrics:
    """The stage histograms (module docstring) and the KV shipped per link."""

    def __init__(self, registry: CollectorRegistry, tenant_labels: int = TENANT_LABELS) -> None:
        r = registry
        self.tenant = BoundedLabel(tenant_labels)

        def histogram(name: str, doc: str, labels: list[str], buckets: tuple[float, ...] = BUCKETS_S) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=r)

        self.queue = histogram("prfaas_job_queue_seconds", "the attempt queued -> its work began", ["placement"])
        self.placement = histogram("prfaas_job_placement_seconds", "the scheduler's decision", ["placement"])
        self.reserve = histogram("prfaas_job_reserve_seconds", "Reserve on the decode region", ["decode_region"])
        self.prefill = histogram("prfaas_job_prefill_seconds", "the prefill", ["placement", "region"])
        self.transfer = histogram(
            "prfaas_job_transfer_seconds", "prefill done -> first token decoded there", ["link", "codec"]
        )
        ends = ["tenant", "placement", "decode_region"]
        self.first_token = histogram("prfaas_job_first_token_seconds", "job created -> first token (TTFT)", ends)
        self.tpot = histogram("prfaas_job_tpot_seconds", "mean s per token after the first", ends, TPOT_BUCKETS_S)
        self.e2e = histogram("prfaas_job_e2e_seconds", "job created -> DONE", ends)
        self.kv_bytes = Counter("prfaas_link_kv_bytes", "KV bytes shipped, raw and on the wire", ["link", "kind"],
                                registry=r)  # fmt: skip
        self.link_seconds = Counter(
            "prfaas_link_transfer_seconds", "seconds of transfer stages on the link", ["link"], registry=r
        )

    def observe(self, job: Mapping[str, Any], stages: Mapping[str, float]) -> None:
        """One finished job's stages (`stage_seconds`)."""
        placement = str(job.get("placement_chosen") or "unknown")
        decode = str(job.get("decode_region") or "")
        prefill = str(job.get("prefill_region") or decode) if placement == "split" else decode
        link = f"{prefill}>{decode}"
        if "queue" in stages:
            self.queue.labels(placement).observe(stages["queue"])
        if "placement" in stages:
            self.placement.labels(placement).observe(stages["placement"])
        if "reserve" in stages:
            self.reserve.labels(decode).observe(stages["reserve"])
        if "prefill" in stages:
            self.prefill.labels(placement, prefill).observe(stages["prefill"])
        if placement == "split":
            if "transfer" in stages:
                self.transfer.labels(link, str(job.get("codec") or "unknown")).observe(stages["transfer"])
                self.link_seconds.labels(link).inc(stages["transfer"])
            self.kv_bytes.labels(link, "raw").inc(int(job.get("bytes_raw", 0) or 0))
            self.kv_bytes.labels(link, "wire").inc(int(job.get("bytes_wire", 0) or 0))
        ends = (self.tenant(str(job.get("tenant", ""))), placement, decode)
        for stage, histogram in (("first_token", self.first_token), ("tpot", self.tpot), ("e2e", self.e2e)):
            if stage in stages:
                histogram.labels(*ends).observe(stages[stage])
