"""Choosing how many TCP streams a channel uses, from what the path delivers.

One TCP stream cannot fill a long, lossy path: CUBIC's window collapses at each loss and
grows back in RTT steps, so its rate falls with RTT and loss. More streams share the
loss and fill the pipe, but past the point where the link is full they only add
queueing and CPU. The operator should not have to know where that point is, so the
channel climbs to it: while data is waiting (the sender is path-limited, not
producer-limited), double the streams as long as goodput grows; when a step brings no
gain, go back to the best count and hold it; probe again after a while, since paths
change. PrfaaS (arXiv 2604.15039) adapts its transfer to congestion the same way.

Pure policy: `StreamController` sees measurements and returns a count; no sockets here.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StreamController:
    """Hill-climbing on goodput.

    initial / min_streams / max_streams: stream counts.
    gain: relative goodput increase that justifies the last step up (0.05 = +5 %).
    interval_s: shortest measurement window; the channel stretches it to >= 8 RTTs.
    hold_intervals: windows to stay at a settled count before probing upward again.
    """

    initial: int = 4
    min_streams: int = 1
    max_streams: int = 64
    gain: float = 0.05
    interval_s: float = 1.0
    hold_intervals: int = 20
    current: int = field(init=False)
    best: int = field(init=False)
    best_rate: float = field(init=False, default=0.0)
    _held: int = field(init=False, default=0)
    _probing: bool = field(init=False, default=True)
    _skip: int = field(init=False, default=0)
    history: list[tuple[float, int, float]] = field(init=False, default_factory=list)  # (t_s, streams, bytes/s)

    def __post_init__(self) -> None:
        if not 1 <= self.min_streams <= self.initial <= self.max_streams:
            raise ValueError("need 1 <= min_streams <= initial <= max_streams")
        self.current = self.best = self.initial

    def window_s(self, rtt_s: float | None) -> float:
        # CUBIC's sawtooth on a lossy long path spans many RTTs: shorter windows measure noise.
        return max(self.interval_s, 8 * rtt_s) if rtt_s else self.interval_s

    def update(self, now_s: float, rate_bps: float, backlogged: bool) -> int:
        """Feed one window's goodput (bytes/s acknowledged) and whether data waited through
        the whole window; returns the stream count to use next."""
        self.history.append((now_s, self.current, rate_bps))
        if not backlogged:
            return self.current  # producer-limited: the window says nothing about the path
        if self._skip:
            self._skip -= 1  # new connections are still in slow start
            return self.current
        if not self._probing:
            self._held += 1
            if self._held < self.hold_intervals or self.current >= self.max_streams:
                return self.current
            self._probing = True  # paths change: probe upward again from here
            self.best, self.best_rate = self.current, rate_bps
            return self._step_up()
        if self.current == self.best:  # first window of a probe: the baseline
            self.best_rate = rate_bps
            return self._step_up()
        if rate_bps >= self.best_rate * (1 + self.gain):
            self.best, self.best_rate = self.current, rate_bps
            return self._step_up()
        return self._settle()  # the step brought less than `gain`: back to the best count

    def _step_up(self) -> int:
        if self.current >= self.max_streams:
            return self._settle()
        self.current = min(self.max_streams, self.current * 2)
        self._skip = 1
        return self.current

    def _settle(self) -> int:
        if self.current != self.best:
            self._skip = 1
        self.current, self._probing, self._held = self.best, False, 0
        return self.current
