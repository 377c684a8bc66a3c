"""What a sender measured on its path, for the registry's link estimates (issue: the
scheduler sees the live fleet).

A channel's reaper closes a measurement window every few RTTs (transport/tcp_sender.py) and
adds it here: the window's length, the bytes the peer's TCP acknowledged in it (TCP_INFO
`bytes_acked`, summed over the streams), whether data was waiting for the path through the
window (backlogged: the path, not the producer, set the rate), the streams' median smoothed
RTT and lowest RTT, and the segments retransmitted. `take()` hands what accumulated since
the last call to the region's heartbeat and starts afresh.

Only backlogged windows measure the path's goodput: a prefill that streams its KV layer by
layer is often slower than the link, and its bytes/s then measure the prefill.
"""

from __future__ import annotations

import statistics
import threading
from collections import deque
from dataclasses import dataclass, field

MAX_RTT_SAMPLES = 512  # the most recent windows' RTTs kept between two reports (a meter nobody reads stays bounded)


@dataclass(frozen=True)
class PathReport:
    """A channel's path since the last report. Units: seconds, bytes."""

    seconds: float  # covered by measurement windows
    bytes_acked: int
    backlogged_s: float  # of `seconds`: data waited for the path
    backlogged_bytes: int  # of `bytes_acked`: acknowledged in backlogged windows
    srtt_s: float | None  # median of the windows' median smoothed RTT; None: no sample
    min_rtt_s: float | None
    retransmits: int  # segments

    @property
    def goodput_bytes_per_s(self) -> float | None:
        """What the path delivered while it was the limit; None without a backlogged window."""
        return self.backlogged_bytes / self.backlogged_s if self.backlogged_s > 0 else None

    @property
    def rate_bytes_per_s(self) -> float:
        """What was sent on average (the path's use by this sender)."""
        return self.bytes_acked / self.seconds if self.seconds > 0 else 0.0


@dataclass
class PathMeter:
    """Windows accumulated until `take`. Thread-safe."""

    _lock: threading.Lock = field(default_factory=threading.Lock)
    _seconds: float = 0.0
    _bytes: int = 0
    _backlogged_s: float = 0.0
    _backlogged_bytes: int = 0
    _srtts: deque[float] = field(default_factory=lambda: deque(maxlen=MAX_RTT_SAMPLES))
    _min_rtt: float | None = None
    _retransmits: int = 0

    def add(self, seconds: float, acked: int, *, backlogged: bool, srtt_s: float | None, min_rtt_s: float | None,
            retransmits: int = 0) -> None:  # fmt: skip
        with self._lock:
            self._seconds += seconds
            self._bytes += acked
            if backlogged:
                self._backlogged_s += seconds
                self._backlogged_bytes += acked
            if srtt_s is not None:
                self._srtts.append(srtt_s)
            if min_rtt_s is not None:
                self._min_rtt = min_rtt_s if self._min_rtt is None else min(self._min_rtt, min_rtt_s)
            self._retransmits += retransmits

    def take(self) -> PathReport | None:
        """What accumulated since the last call (None when no window closed)."""
        with self._lock:
            if self._seconds <= 0:
                return None
            report = PathReport(self._seconds, self._bytes, self._backlogged_s, self._backlogged_bytes,
                                statistics.median(self._srtts) if self._srtts else None, self._min_rtt,
                                self._retransmits)  # fmt: skip
            self._seconds, self._bytes, self._backlogged_s, self._backlogged_bytes = 0.0, 0, 0.0, 0
            self._srtts.clear()
            self._min_rtt, self._retransmits = None, 0
            return report
