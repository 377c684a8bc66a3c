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
- utilization: what this path carries now over its bandwidth: the sum of its senders' smoothed
  sending rates (each instance of the prefill region smoothed on its own; one beat's reports on
  one peer, a channel per decode instance, merged first), so concurrent senders add up.
An estimate not refreshed for `STALE_S` is ignored (the configured link again). Goodput stays one
series: senders that share a bottleneck each measure their share of it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict, ValidationError

from prfaas.control_plane.scheduling.snapshot import MAX_BANDWIDTH_GBPS, MAX_RTT_MS, Link
from prfaas.protos.prfaas.v1 import registry_pb2

log = logging.getLogger(__name__)
PRIOR_S = 2.0  # backlogged seconds before the measured goodput fully replaces the configured bandwidth
TAU_S = 5.0  # smoothing time constant, s of measurement
STALE_S = 120.0  # an estimate older than this is ignored
SENDER_QUIET_S = 15.0  # a sender with no report for this long sends nothing on the path now
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
    senders: dict[str, tuple[float, float]] = {}  # sender (instance) -> (its smoothed sending rate, updated_at)

    def updated(self, report: registry_pb2.LinkReport, now: float, sender: str = "") -> LinkEstimate:
        """This estimate with one report of `sender` (an instance of the source region) folded in; a report
        with a figure no path gives (not finite, negative, an RTT over MAX_RTT_MS, a rate over MAX_BYTES_PER_S)
        is dropped whole. `now`: Redis's clock (fleet/registry.py `clock`), as every reader of the estimate."""
        if not _plausible(report):
            return self
        seconds = report.seconds
        goodput = self.goodput_bytes_per_s
        if report.backlogged_s >= MIN_RATE_S and report.backlogged_bytes > 0:
            goodput = _smooth(goodput, report.backlogged_bytes / report.backlogged_s, report.backlogged_s)
        rate = report.bytes_acked / seconds if seconds >= MIN_RATE_S else 0.0
        previous = self.senders.get(sender)
        senders = {s: v for s, v in self.senders.items() if now - v[1] <= SENDER_QUIET_S and s != sender}
        senders[sender] = (_smooth(previous[0] if previous else None, rate, seconds) or 0.0, now)
        return self.model_copy(
            update={
                "goodput_bytes_per_s": goodput,
                "sending_bytes_per_s": sum(r for r, _at in senders.values()),
                "senders": senders,
                "srtt_ms": _smooth(self.srtt_ms, report.srtt_ms, seconds) if report.srtt_ms > 0 else self.srtt_ms,
                "min_rtt_ms": (
                    _smooth(self.min_rtt_ms, report.min_rtt_ms, seconds) if report.min_rtt_ms > 0 else self.min_rtt_ms
                ),
                "backlogged_bytes": self.backlogged_bytes + report.backlogged_bytes,
                "backlogged_s": self.backlogged_s + report.backlogged_s,
                "bytes_acked": self.bytes_acked + report.bytes_acked,
                "retransmits": self.retransmits + report.retransmits,
                "updated_at": now,
            }
        )

    def sending_at(self, now: float) -> float:
        """Bytes/s the path carries at `now` (Redis's clock): the sum of the senders heard from within
        SENDER_QUIET_S."""
        if not self.senders:  # stored before senders were kept apart
            return self.sending_bytes_per_s
        return sum(rate for rate, at in self.senders.values() if now - at <= SENDER_QUIET_S)

    def age_s(self, now: float) -> float:
        """Seconds since its last report, at `now` on Redis's clock (the estimates are stamped on it: a host's own
        clock would age them by its skew)."""
        return max(0.0, now - self.updated_at)

    @property
    def measured_gbps(self) -> float | None:
        return None if self.goodput_bytes_per_s is None else self.goodput_bytes_per_s * 8 / 1e9

    @property
    def weight(self) -> float:
        """How far the measured goodput replaces the configured bandwidth (0..1)."""
        return 0.0 if self.goodput_bytes_per_s is None else min(1.0, self.backlogged_s / PRIOR_S)


def stored_estimate(raw: bytes | None, src: str, dst: str) -> LinkEstimate:
    """The stored estimate of src>dst, or a new one (none stored, or unreadable)."""
    if raw:
        try:
            return LinkEstimate.model_validate_json(raw)
        except ValidationError:
            log.warning("link %s>%s: unreadable estimate replaced", src, dst)
    return LinkEstimate(src=src, dst=dst)


def merged(reports: Sequence[registry_pb2.LinkReport]) -> registry_pb2.LinkReport:
    """One sender's reports on one peer in one beat (a channel per decode instance, at the same time) as one:
    bytes add up, the seconds overlap, the RTTs are the channels' (byte-weighted, and the least)."""
    reports = [r for r in reports if _plausible(r)] or list(reports[:1])  # one odd channel spoils no other
    if len(reports) == 1:
        return reports[0]
    acked = sum(r.bytes_acked for r in reports)
    rtts = [r.min_rtt_ms for r in reports if r.min_rtt_ms > 0]
    weighted = [(r.srtt_ms, max(1, r.bytes_acked)) for r in reports if r.srtt_ms > 0]
    return registry_pb2.LinkReport(
        peer_region=reports[0].peer_region, seconds=max(r.seconds for r in reports), bytes_acked=acked,
        backlogged_s=max(r.backlogged_s for r in reports), backlogged_bytes=sum(r.backlogged_bytes for r in reports),
        srtt_ms=sum(x * w for x, w in weighted) / sum(w for _x, w in weighted) if weighted else 0.0,
        min_rtt_ms=min(rtts, default=0.0), retransmits=sum(r.retransmits for r in reports),
    )  # fmt: skip


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


def effective(link: Link, estimate: LinkEstimate | None, now: float) -> Link:
    """The link as the scheduler sees it at `now` (Redis's clock): the configured one, moved by a fresh estimate."""
    if estimate is None or estimate.age_s(now) > STALE_S:
        return link
    bandwidth = link.bandwidth_gbps
    measured = estimate.measured_gbps
    if measured is not None:
        bandwidth = estimate.weight * measured + (1.0 - estimate.weight) * link.bandwidth_gbps
    rtt = estimate.min_rtt_ms if estimate.min_rtt_ms is not None else link.rtt_ms
    sending_gbps = estimate.sending_at(now) * 8 / 1e9
    utilization = min(1.0, sending_gbps / bandwidth) if bandwidth > 0 else 0.0
    return link.model_copy(update={"bandwidth_gbps": bandwidth, "rtt_ms": rtt, "utilization": utilization})
