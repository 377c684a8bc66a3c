"""A WAN link as a shared fluid pipe: every shipment in flight gets a max-min fair share of
the link's goodput (TCP flows sharing one bottleneck), capped by how fast its prefill produces
KV (layer-wise streaming cannot send a layer before it exists) and by its own ceiling (the
codec's encode rate, the TCP windows of its streams per round trip: `ship(max_rate=...)`).

Event-driven, not per byte: between two changes (a shipment joins, leaves, or its prefill
ends) every rate is constant, so the link schedules one wake-up at the earliest of the next
completion and the next prefill end; a later change supersedes it (`_generation`). A wake-up
is never sooner than one float step of the clock (`math.ulp(now)`): at a large simulated time
(a trace in epoch seconds) a shorter delay would leave the clock where it is, and the link
would wake at the same instant forever.
"""

from __future__ import annotations

import math

import simpy

from prfaas.sim.fleet import LinkSpec

_EPS_BYTES = 1e-3  # a shipment with less than this left is done (float residue)


class _Flow:
    __slots__ = ("cap", "cap_until", "done", "max_rate", "rate", "remaining", "wire_bytes")

    def __init__(self, wire_bytes: int, cap: float, cap_until: float, max_rate: float, done: simpy.Event) -> None:
        self.wire_bytes = wire_bytes
        self.remaining = float(wire_bytes)  # bytes still to send
        self.max_rate = max_rate  # bytes/s it never exceeds (encode rate, stream windows); inf: none
        self.cap = min(cap, max_rate)  # bytes/s the prefill produces until `cap_until`; max_rate after
        self.cap_until = cap_until
        self.rate = 0.0  # bytes/s allocated now
        self.done = done


class FluidLink:
    """One directed link. `ship(...)` returns an event that fires when the last byte has left
    the sender (propagation, RTT/2, is the caller's to add)."""

    def __init__(self, env: simpy.Environment, spec: LinkSpec, num_layers: int) -> None:
        self.env = env
        self.spec = spec
        self.num_layers = num_layers
        self.capacity = spec.goodput_bytes_per_s  # bytes/s
        self.flows: list[_Flow] = []
        self.bytes_carried = 0  # wire bytes of completed shipments
        self.num_splits = 0
        self.busy_s = 0.0  # time with at least one shipment in flight
        self.peak_flows = 0
        self._last = 0.0
        self._generation = 0
        self.version = 0  # bumped on every change of the rates (snapshot caching)

    @property
    def rate_in_use(self) -> float:
        return sum(flow.rate for flow in self.flows)

    @property
    def utilization(self) -> float:
        """Share of the goodput in use now (what a link probe would measure); 1 when dead."""
        if self.capacity <= 0:
            return 1.0
        return min(1.0, self.rate_in_use / self.capacity)

    @property
    def backlog_bytes(self) -> float:
        return sum(flow.remaining for flow in self.flows)

    def ship(self, wire_bytes: int, prefill_s: float, max_rate: float = math.inf) -> simpy.Event:
        """Start a shipment of `wire_bytes` whose prefill (starting now) takes `prefill_s`:
        all layers but the last stream at the prefill's pace, the last one after it ends; never
        faster than `max_rate` wire bytes/s (inf: only the link and the prefill limit it)."""
        if self.capacity <= 0:
            raise AssertionError(f"split placed on zero-bandwidth link {self.spec.src}->{self.spec.dst}")
        if not max_rate > 0:
            raise AssertionError(f"a shipment's max_rate must be positive, got {max_rate}")
        self._advance()
        done = self.env.event()
        now = float(self.env.now)
        streamed = wire_bytes * (self.num_layers - 1) / self.num_layers
        cap = streamed / prefill_s if prefill_s > 0 else math.inf
        self.flows.append(_Flow(wire_bytes, cap, now + prefill_s, max_rate, done))
        self.peak_flows = max(self.peak_flows, len(self.flows))
        self._reallocate()
        return done

    def _advance(self) -> None:
        now = float(self.env.now)
        dt = now - self._last
        if dt > 0 and self.flows:
            self.busy_s += dt
            for flow in self.flows:
                flow.remaining -= flow.rate * dt
        self._last = now

    def _reallocate(self) -> None:
        """Finish what is done, lift the caps of prefills that ended, water-fill the rest."""
        now = float(self.env.now)
        lifted = now + 1e-12
        still: list[_Flow] = []
        capped = 0.0  # sum of the caps (inf when a flow has none)
        for flow in self.flows:
            if flow.cap_until <= lifted:
                if flow.remaining <= _EPS_BYTES + 1e-9 * flow.wire_bytes:
                    self.bytes_carried += flow.wire_bytes
                    self.num_splits += 1
                    flow.done.succeed()
                    continue
                flow.cap = flow.max_rate
            capped += flow.cap
            still.append(flow)
        self.flows = still
        self.version += 1
        if not still:
            return
        if capped <= self.capacity:
            for flow in still:  # every capped flow fits: each runs at its cap
                flow.rate = flow.cap
        else:  # max-min fair: flows capped below an equal share keep their cap, the rest split what is left
            left = self.capacity
            pending = sorted(still, key=lambda f: f.cap)
            for i, flow in enumerate(pending):
                flow.rate = min(flow.cap, left / (len(pending) - i))
                left -= flow.rate
        wake = math.inf
        for flow in still:
            if flow.cap_until > now:
                until = flow.cap_until - now  # its cap lifts first: remaining > 0 until then
            else:
                until = flow.remaining / flow.rate if flow.rate > 0 else math.inf
            if until < wake:
                wake = until
        self._generation += 1
        generation = self._generation
        timer = self.env.timeout(max(wake, math.ulp(now)))  # at least one step of the clock (module docstring)
        timer.callbacks.append(lambda _event: self._wake(generation))

    def _wake(self, generation: int) -> None:
        if generation != self._generation:
            return  # superseded by a later change
        self._advance()
        self._reallocate()
