"""Choosing how many TCP streams a channel uses, from what the path delivers.

One TCP stream cannot fill a long, lossy path: CUBIC's window collapses at each loss and
grows back in RTT steps, so its rate falls with RTT and loss. More streams share the
loss and fill the pipe, but past the point where the link is full they only add
queueing and CPU. The operator should not have to know where that point is, so the
channel climbs to it while data is waiting (path-limited, not producer-limited).

The signal is queueing delay: the kernel's smoothed RTT of the streams (median over the
window) minus the path's minimum RTT (TCP_INFO). A full bottleneck builds a queue, so RTT
rises above its minimum; a path that is not full (loss-limited streams, or too few of
them) shows none. PrfaaS (arXiv 2604.15039) watches congestion the same way. Goodput per
window does not work on such paths: new streams' slow-start bursts and loss collapses made
one count measure anywhere from 0.5 to 37 MB/s on the intercontinental bench link.

Rules, per window, while backlogged, on a WAN path (minimum RTT >= `lan_rtt_s`):
- no queue → double the count (up to `max_streams`): the link has room;
- queue → the link is full: hold this count.
A path with no queue is not always one with room: when the sender's CPU (encoding, the stream
threads) is the limit, the link shows no queue at any count and more streams only cost CPU (kvw4
on the intercontinental bench: 3.3x at 4 streams, 2.4-2.6x at 8-32). So a step taken on delay is
a trial: if the best of its first `trial_windows` windows delivers less than the median of the
count before it, the step is undone and the next probe waits twice as long (up to 8x). Best
against median, not mean against mean: one window's goodput on a lossy path swings from a loss
collapse to a slow-start burst, and a single bad window must not undo a climb that pays.
On a LAN path (or without TCP_INFO) delay says nothing: start from `min_streams` and
hill-climb on goodput, a step must gain `gain` or it is undone.
After `hold_intervals` windows, or `reprobe_clear` windows in a row without a queue (unless the
last probe was undone), probe upward again (slow-start overshoot ends, paths change).
A window that delivers nothing (every stream reconnecting, the receiver gone) says nothing about a
count, nor does one without TCP_INFO on a path already seen to be a WAN: an outage must not read as
"no queue, room for more streams".

Pure policy: `StreamController` sees measurements and returns a count; no sockets here.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

LAN_RTT_S = 0.001  # below: same host or region, where a queue is too small to see
HISTORY_WINDOWS = 600  # windows kept in `StreamController.history` (~10 minutes at 1 s a window)


@dataclass(frozen=True)
class PathSample:
    """Delay of the path over one window, from the kernel's per-connection TCP_INFO."""

    srtt_s: float  # median smoothed RTT of the streams
    min_rtt_s: float  # lowest RTT any stream has seen

    def queued(self, threshold: float) -> bool:
        """Whether the RTT rose above the path's minimum by more than `threshold` of it (2 ms at least)."""
        return self.srtt_s - self.min_rtt_s > max(0.002, threshold * self.min_rtt_s)


@dataclass
class StreamController:
    """Goodput and delay driven stream count.

    initial / min_streams / max_streams: stream counts.
    gain: relative goodput increase that justifies a step up when delay cannot tell (0.05 = +5 %).
    queue_threshold: queueing delay, as a share of the minimum RTT, that means the link is full.
    lan_rtt_s: below this minimum RTT (same host, same region) a queue is too small to see and one
        stream's window covers the path: start from `min_streams` and climb on goodput alone.
    interval_s: shortest measurement window; the channel stretches it to >= 8 RTTs.
    hold_intervals: windows to stay at a settled count before probing upward again.
    reprobe_clear: on a WAN path, consecutive backlogged windows without a queue that end the
        hold early (the queue that stopped the climb was a transient, or the path changed).
    trial_windows: windows with data waiting (`backlogged` or `waiting`) after a step on delay that judge it.
    """

    initial: int = 4
    min_streams: int = 1
    max_streams: int = 64
    gain: float = 0.05
    queue_threshold: float = 0.2
    lan_rtt_s: float = LAN_RTT_S
    interval_s: float = 1.0
    hold_intervals: int = 20
    reprobe_clear: int = 3
    trial_windows: int = 2
    current: int = field(init=False)
    _rates: dict[int, float] = field(init=False, default_factory=dict)  # this probe's best rate per count
    _lan: bool = field(init=False, default=False)
    _wan: bool = field(init=False, default=False)  # a delay signal seen on a WAN path
    _clear: int = field(init=False, default=0)  # backlogged windows in a row without a queue, while holding
    _held: int = field(init=False, default=0)
    _probing: bool = field(init=False, default=True)
    _skip: int = field(init=False, default=0)
    _recent: deque[float] = field(init=False)  # active windows' rates at this count (the last 5, or trial_windows)
    _trial: list[float] = field(init=False, default_factory=list)  # the step on trial: its windows' rates
    _trial_from: int | None = field(init=False, default=None)  # the count it stepped up from
    _trial_base: float = field(init=False, default=0.0)  # the median rate at that count
    _undone: int = field(init=False, default=0)  # probes undone in a row: each doubles the next hold
    # the last HISTORY_WINDOWS windows: (t_s, streams, bytes/s, queueing delay s or None, backlogged)
    history: deque[tuple[float, int, float, float | None, bool]] = field(
        init=False, default_factory=lambda: deque(maxlen=HISTORY_WINDOWS)
    )

    def __post_init__(self) -> None:
        if not 1 <= self.min_streams <= self.initial <= self.max_streams:
            raise ValueError("need 1 <= min_streams <= initial <= max_streams")
        if self.trial_windows < 1:
            raise ValueError("trial_windows must be at least 1")
        self._recent = deque(maxlen=max(5, self.trial_windows))
        self.current = self.initial
        self._skip = 1  # the first window's connections are in slow start: its queue is an overshoot

    def window_s(self, rtt_s: float | None) -> float:
        # CUBIC's sawtooth on a lossy long path spans many RTTs: shorter windows measure noise.
        return max(self.interval_s, 8 * rtt_s) if rtt_s else self.interval_s

    def update(
        self, now_s: float, rate_bps: float, backlogged: bool, path: PathSample | None = None, waiting: bool = False
    ) -> int:
        """Feed one window's goodput (bytes/s acknowledged), whether data waited for the path
        through the whole window (`backlogged`), whether data waited in the sender itself through it
        (`waiting`: layers not yet encoded, the CPU the limit), and the path's delay if known; returns
        the stream count to use next."""
        self.history.append((now_s, self.current, rate_bps, path.srtt_s - path.min_rtt_s if path else None, backlogged))
        if path is not None and path.min_rtt_s < self.lan_rtt_s:
            path = None  # too short a path for delay to tell anything
            if not self._lan:  # first sight of a LAN path: more streams only add CPU and locks
                self._lan = True
                if self.current != self.min_streams:
                    self._rates = {}
                    return self._restart(self.min_streams)
        elif path is not None:
            self._wan = True
        elif self._wan:
            return self.current  # TCP_INFO gone on a WAN path (streams reconnecting): no measure of this count
        if not (backlogged or waiting):
            return self.current  # nothing to send: the window says nothing about the path
        if rate_bps <= 0:
            return self.current  # nothing delivered with data waiting: an outage, not this count's goodput
        if self._skip:
            self._skip -= 1  # new connections are still in slow start
            return self.current
        self._recent.append(rate_bps)  # data waited: this count's goodput is what the channel delivers
        if self._trial_from is not None and self._judge(rate_bps):
            return self.current  # undone
        if not backlogged:
            return self.current  # producer-limited: the window says nothing about the path
        queued = path.queued(self.queue_threshold) if path is not None else None
        if not self._probing:
            self._held += 1
            self._clear = 0 if queued or queued is None else self._clear + 1
            if self.current >= self.max_streams or queued:
                return self.current
            hold = self.hold_intervals * 2 ** min(self._undone, 3)
            if self._held < hold and (self._clear < self.reprobe_clear or self._undone):
                return self.current
            self._probing = True  # paths change: probe upward again from here
            self._rates = {self.current: rate_bps}
            return self._step_up(by_delay=queued is not None)  # with a delay signal, on trial
        self._rates[self.current] = max(rate_bps, self._rates.get(self.current, 0.0))
        if queued is None:  # no delay signal: a step must pay for itself
            previous = self._rates.get(self.current // 2)
            if previous is None or rate_bps >= previous * (1 + self.gain):
                return self._step_up()
            return self._settle(self._top())
        # Delay decides: one window's goodput on a long lossy path is dominated by new streams'
        # slow-start bursts and loss collapses (measured: 0.5 to 37 MB/s at one count).
        if queued:  # the link is full: this count is enough (a step on trial is still judged)
            return self._settle(self.current, keep_trial=True)
        if len(self._recent) < self.trial_windows:
            return self.current  # measuring this count: the step that led here is on trial, the next needs a base
        return self._step_up(by_delay=True)  # no queue: the link has room, more streams may use it

    def _judge(self, rate_bps: float) -> bool:
        """One more window of the step on trial; True when it is undone."""
        self._trial.append(rate_bps)
        if len(self._trial) < self.trial_windows:
            return False
        origin, paid = self._trial_from, max(self._trial) >= self._trial_base
        self._trial_from, self._trial = None, []
        if paid:
            self._undone = 0
            return False
        assert origin is not None
        self._undone += 1
        self._settle(origin)
        return True

    def _restart(self, count: int) -> int:
        """Probe again from `count`."""
        self.current, self._probing, self._skip = count, True, 1
        self._trial_from, self._trial = None, []
        self._recent.clear()
        return count

    def _top(self) -> int:
        """The count this probe measured best, a larger one only where it beat the smaller by `gain`: a
        step within the noise is undone, not kept (kept, +2 % per doubling ratchets up to `max_streams`)."""
        counts = sorted(self._rates)
        best = counts[0]
        for count in counts[1:]:
            if self._rates[count] >= self._rates[best] * (1 + self.gain):
                best = count
        return best

    def _step_up(self, by_delay: bool = False) -> int:
        if self.current >= self.max_streams:  # no queue even at the top: stay there
            return self._settle(self.current if by_delay else self._top())
        if by_delay and self._recent:  # judged against what this count delivered
            self._trial_from, self._trial_base, self._trial = self.current, statistics.median(self._recent), []
        self.current = min(self.max_streams, self.current * 2)
        self._skip = 1
        self._recent.clear()
        return self.current

    def _settle(self, count: int, keep_trial: bool = False) -> int:
        """Hold `count`; `keep_trial`: it is the count on trial, whose remaining windows still judge it."""
        if count != self.current:
            self._skip = 1
            self._recent.clear()
        self.current, self._probing, self._held, self._clear = count, False, 0, 0
        if not keep_trial:
            self._trial_from, self._trial = None, []
        return self.current
