"""A region's decode pool as one continuous batch, advanced per batch iteration analytically.

Every sequence in the pool takes one token per step; a step's time depends on the batch
(sequences per worker) and the context they hold (`WorkerTimings.decode_step_s`). Between two
changes (a sequence joins or finishes) the batch is fixed and the context grows by one token
per sequence per step, so the step time grows by a fixed amount per step (exactly for a step
time linear in context: the measured and roofline models; the secant for anything else): k
steps take k step times at their mean context, a + b k / 2 each. The pool keeps a step counter
`steps` that advances by inverting that (a quadratic) over the elapsed time, and schedules one
wake-up at the next finish; a join or finish recomputes a and b, so a late joiner slows
everyone (no per-token events, no per-request loops: O(log n) per change).

Sequences are spread evenly over the workers (ideal load balancing): batch per worker =
ceil(sequences / workers), context per worker = total context / workers. The context of a
sequence grows by one token per step: total = sum(prompt - joined_at_step) + n * steps.

The first token is the prefill's (the region streams it as the sequence joins the batch), so
a sequence of n output tokens takes n - 1 steps here, and its TPOT is their mean.

A worker with a `max_batch` holds at most that many sequences; the pool at most
max_batch * workers. A sequence arriving at a full pool waits, first come first served, and
joins when one finishes (its wait is part of its TTFT: its first token comes out of decode).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass

import simpy

from prfaas.sim.hardware import WorkerTimings


class _Sequence:
    __slots__ = ("ctx_base", "done", "first_s", "output_tokens")

    def __init__(self, ctx_base: float, output_tokens: int, first_s: float, done: simpy.Event) -> None:
        self.ctx_base = ctx_base  # prompt tokens - pool steps at join: its context is ctx_base + steps
        self.output_tokens = output_tokens
        self.first_s = first_s
        self.done = done


@dataclass(frozen=True)
class DecodeResult:
    first_token_s: float  # simulated time the first token came out
    finish_s: float
    tpot_s: float  # mean time per output token after the first


class DecodePool:
    def __init__(self, env: simpy.Environment, worker: WorkerTimings, num_workers: int) -> None:
        self.env = env
        self.worker = worker
        self.num_workers = max(1, num_workers)
        self.steps = 0.0  # batch iterations run since the start (fractional between events)
        self.num_sequences = 0
        self._ctx_base = 0.0  # sum over sequences of (prompt tokens - steps at join)
        self._heap: list[tuple[float, int, _Sequence]] = []  # (finish step, join order, sequence)
        self._seq = 0
        self._last = 0.0
        self.step_s = worker.decode_step_s(1, 0)  # s: the step at the current context
        self._step_growth_s = 0.0  # s per step: how much each step adds to the next (the context it grew)
        self.busy_s = 0.0  # time with at least one sequence decoding
        self._generation = 0
        self.version = 0  # bumped on every change (snapshot caching)
        cap = worker.max_batch
        self.max_sequences = None if cap is None else cap * self.num_workers
        self.waiting: deque[tuple[int, int, simpy.Event]] = deque()  # (prompt, output, done) for a free slot

    @property
    def context_tokens(self) -> float:
        return self._ctx_base + self.num_sequences * self.steps

    def step_with(self, extra_sequences: int = 0, extra_ctx: int = 0) -> float:
        """Step time if `extra_sequences` holding `extra_ctx` tokens joined now."""
        n = self.num_sequences + extra_sequences
        if n <= 0:
            return self.worker.decode_step_s(1, 0)
        batch = math.ceil(n / self.num_workers)
        return self.worker.decode_step_s(batch, int((self.context_tokens + extra_ctx) / self.num_workers))

    def decode(self, prompt_tokens: int, output_tokens: int) -> simpy.Event:
        """Join the batch now (or, when it is full, once a slot frees); the event's value is a
        `DecodeResult` once `output_tokens` are out."""
        self._advance()
        done = self.env.event()
        if output_tokens <= 1:  # the prefill's token is the whole answer
            now = float(self.env.now)
            done.succeed(DecodeResult(now, now, 0.0))
            return done
        if self.max_sequences is not None and self.num_sequences >= self.max_sequences:
            self.waiting.append((prompt_tokens, output_tokens, done))
            self.version += 1
            return done
        self._join(prompt_tokens, output_tokens, done)
        self._reschedule()
        return done

    def _join(self, prompt_tokens: int, output_tokens: int, done: simpy.Event) -> None:
        now = float(self.env.now)
        base = prompt_tokens - self.steps
        self.num_sequences += 1
        self._ctx_base += base
        # token 0 goes out now; the other output_tokens - 1 take a step each at the batch's pace
        heapq.heappush(
            self._heap, (self.steps + output_tokens - 1, self._seq, _Sequence(base, output_tokens, now, done))
        )
        self._seq += 1

    def _advance(self) -> None:
        now = float(self.env.now)
        dt = now - self._last
        if dt > 0 and self.num_sequences:
            # k steps from here take a k + b k^2 / 2 (a: this step, b: growth per step): its root in k for dt,
            # in the form that stays exact as b -> 0
            a, b = self.step_s, self._step_growth_s
            advanced = 2 * dt / (a + math.sqrt(max(0.0, a * a + 2 * b * dt)))
            self.steps += advanced
            self.step_s = a + b * advanced
            self.busy_s += dt
        self._last = now

    def _reschedule(self) -> None:
        """After a change: the step time now, its growth per step up to the next finish (the secant), and the
        wake-up at that finish."""
        self.version += 1
        self._generation += 1
        self.step_s, self._step_growth_s = self.step_with(), 0.0
        if not self._heap:
            return
        generation = self._generation
        steps = max(0.0, self._heap[0][0] - self.steps)
        if steps > 0:  # the context then holds every sequence's `steps` tokens more
            self._step_growth_s = (self.step_with(extra_ctx=round(self.num_sequences * steps)) - self.step_s) / steps
        # at least one float step of the clock: at a large simulated time (a trace in epoch seconds) a shorter
        # delay leaves env.now where it is, no step is counted, and the pool would wake at that instant forever
        delay = max(math.ulp(float(self.env.now)), steps * (self.step_s + self._step_growth_s * steps / 2))
        timer = self.env.timeout(delay)
        timer.callbacks.append(lambda _event: self._wake(generation))

    def _wake(self, generation: int) -> None:
        if generation != self._generation:
            return
        self._advance()
        now = float(self.env.now)
        heap = self._heap
        while heap and heap[0][0] <= self.steps + 1e-6:
            _, _, seq = heapq.heappop(heap)
            self.num_sequences -= 1
            self._ctx_base -= seq.ctx_base
            seq.done.succeed(DecodeResult(seq.first_s, now, (now - seq.first_s) / (seq.output_tokens - 1)))
        if not self.num_sequences:
            self._ctx_base = 0.0  # drop the float residue of the departed
        while self.waiting and (self.max_sequences is None or self.num_sequences < self.max_sequences):
            self._join(*self.waiting.popleft())
        self._reschedule()
