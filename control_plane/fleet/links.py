"""Measured links: what the KV senders report in their heartbeats, smoothed per directed link,
with the operator's configured figures as the prior.

A prefill region's heartbeat carries, per decode region it ships to, what its channels
measured since the last beat (transport/pathmeter.py): bytes acknowledged, the part sent
while data waited for the path (only that measures goodput: a layer-by-layer prefill is
often slower than its link), RTTs and retransmits. `LinkEstimate.updated` folds one report
into the estimate with exponential smoothing over the report's own seconds (time constant
`TAU_S`), so a path whose rate changes is followed within seconds.

`effective(link, estimate)` is the link the scheduler sees:
- bandwidth: the configured figure blended towards the measured goodput as backlogged
  measurement accumulates (weight = backlogged seconds / `PRIOR_S`, 1 from there on: seconds,
  not bytes, so a slow path and a fast one earn their weight alike);
- RTT: the measured minimum RTT once there is a sample (the path's base delay; queueing
  shows in the utilization instead);
- utilization: what this path carries now (smoothed sending rate) over its bandwidth.
An estimate not refreshed for `STALE_S` is ignored (the configured link again).
"""

from __future__ import annotations

import math
import time

from pydantic import BaseModel, ConfigDict

from prfaas.control_plane.scheduling.snapshot import MAX_BANDWIDTH_GBPS, MAX_RTT_MS, Link
from prfaas.protos.prfaas.v1 import registry_pb2

PRIOR_S = 2.0  # backlogged seconds before the measured goodput fully replaces the configured bandwidth
TAU_S = 5.0  # smoothing time constant, s of measurement
STALE_S = 120.0  # an estimate older than this is ignored
MAX_REPORT_S = 3600.0  # a report covers at most this much time (beats come every few seconds)
MIN_RATE_S = 1e-3  # a report's seconds below this give no rate (a sample too short to divide by)
MAX_BYTES_PER_S = MAX_BANDWIDTH_GBPS * 1e9 / 8  # a rate above is a broken meter


class LinkEstimate(BaseModel):
    """The smoothed measurements of one directed link. Units: bytes, seconds, ms; `updated_at`:
    seconds since the epoch."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    src: str
    dst: str
    goodput_bytes_per_s: float | None = None  # None until a backlogged window was seen
    sending_bytes_per_s: float = 0.0
    srtt_ms: float | None = None
    min_rtt_ms: float | None = None
    backlogged_bytes: int = 0  # all reports together
    backlogged_s: float = 0.0
    bytes_acked: int = 0
    retransmits: int = 0
    updated_at: float = 0.0

    def updated(self, report: registry_pb2.LinkReport, now: float | None = None) -> LinkEstimate:
        """This estimate with one report folded in; a report with a figure no path gives (not finite, negative,
        an RTT over MAX_RTT_MS, a rate over MAX_BYTES_PER_S) is dropped whole."""
        if not _plausible(report):
            return self
        seconds = report.seconds
        goodput = self.goodput_bytes_per_s
        if report.backlogged_s >= MIN_RATE_S and report.backlogged_bytes > 0:
            goodput = _smooth(goodput, report.backlogged_bytes / report.backlogged_s, report.backlogged_s)
        rate = report.bytes_acked / seconds if seconds >= MIN_RATE_S else 0.0
        return self.model_copy(
            update={
                "goodput_bytes_per_s": goodput,
                "sending_bytes_per_s": _smooth(self.sending_bytes_per_s, rate, seconds) or 0.0,
                "srtt_ms": _smooth(self.srtt_ms, report.srtt_ms, seconds) if report.srtt_ms > 0 else self.srtt_ms,
                "min_rtt_ms": (
                    _smooth(self.min_rtt_ms, report.min_rtt_ms, seconds) if report.min_rtt_ms > 0 else self.min_rtt_ms
                ),
                "backlogged_bytes": self.backlogged_bytes + report.backlogged_bytes,
                "backlogged_s": self.backlogged_s + report.backlogged_s,
                "bytes_acked": self.bytes_acked + report.bytes_acked,
                "retransmits": self.retransmits + report.retransmits,
                "updated_at": time.time() if now is None else now,
            }
        )

    def age_s(self, now: float | None = None) -> float:
        return max(0.0, (time.time() if now is None else now) - self.updated_at)

    @property
    def measured_gbps(self) -> float | None:
        return None if self.goodput_bytes_per_s is None else self.goodput_bytes_per_s * 8 / 1e9

    @property
    def weight(self) -> float:
        """How far the measured goodput replaces the configured bandwidth (0..1)."""
        return 0.0 if self.goodput_bytes_per_s is None else min(1.0, self.backlogged_s / PRIOR_S)


def _plausible(r: registry_pb2.LinkReport) -> bool:
    times = (r.seconds, r.backlogged_s)
    if not all(0.0 <= t <= MAX_REPORT_S for t in times) or not all(
        0.0 <= x <= MAX_RTT_MS for x in (r.srtt_ms, r.min_rtt_ms)
    ):
        return False  # NaN fails every comparison
    rates = (r.bytes_acked / max(r.seconds, MIN_RATE_S), r.backlogged_bytes / max(r.backlogged_s, MIN_RATE_S))
    return all(rate <= MAX_BYTES_PER_S for rate in rates)


def _smooth(previous: float | None, sample: float, seconds: float) -> float | None:
    """Exponential smoothing over `seconds` of measurement: a sample covering TAU_S moves the
    estimate ~63% of the way."""
    if previous is None:
        return sample
    alpha = 1.0 - math.exp(-seconds / TAU_S)
    return previous + alpha * (sample - previous)


def effective(link: Link, estimate: LinkEstimate | None, now: float | None = None) -> Link:
    """The link as the scheduler sees it: the configured one, moved by a fresh estimate."""
    if estimate is None or estimate.age_s(now) > STALE_S:
        return link
    bandwidth = link.bandwidth_gbps
    measured = estimate.measured_gbps
    if measured is not None:
        bandwidth = estimate.weight * measured + (1.0 - estimate.weight) * link.bandwidth_gbps
    rtt = estimate.min_rtt_ms if estimate.min_rtt_ms is not None else link.rtt_ms
    sending_gbps = estimate.sending_bytes_per_s * 8 / 1e9
    utilization = min(1.0, sending_gbps / bandwidth) if bandwidth > 0 else 0.0
    return link.model_copy(update={"bandwidth_gbps": bandwidth, "rtt_ms": rtt, "utilization": utilization})
