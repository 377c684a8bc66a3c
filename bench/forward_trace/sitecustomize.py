"""Where each forward's wall time went, inside every region process of a benchmark run (Linux).

    PYTHONPATH=$PWD/bench/forward_trace PRFAAS_FORWARD_TRACE=/tmp/fwd.jsonl prfaas up ...

Python imports this file at start-up (it is `sitecustomize` on PYTHONPATH). In a region
process with PRFAAS_FORWARD_TRACE set, it wraps `HFEngine.prefill` and appends one JSON line
per forward: pid, tokens, path, tapped, and the calling thread's
    wall_s     monotonic clock around the forward
    cpu_s      the thread's time on a CPU (/proc/thread-self/schedstat, field 1)
    runq_s     time runnable but waiting for a core (field 2): other threads and processes
    blocked_s  the rest: waiting for the GIL, a lock or I/O; at least 0 (see below)
    switches   voluntary and involuntary context switches (/proc/thread-self/status)
`path` is which role called the forward: "split" (the prefill region's backend: a split job's
prefill, shipping its layers), "local" (the decode region's Generate: a local job) or "other";
it comes from the caller's module, so a region of role `both` is classified right too.
`tapped` (an `on_layer` callback was passed) does not tell them apart: the decode region's
Generate passes one too (its cancel and deadline checks between layers).

wall_s is CLOCK_MONOTONIC; cpu_s and runq_s are the scheduler's own clock, and the kernel
brings a running thread's CPU time up to date only at scheduler events and ticks, so it can
run ahead of or behind the wall clock by a tick or so. The wall clock's two reads enclose the
schedstat reads, and blocked_s is clamped at 0: a forward that never blocked shows 0, not a
few negative milliseconds.
Nothing changes for any other process, or when the variable is unset.
"""

from __future__ import annotations

import os
import sys

SPLIT, LOCAL = "prfaas.prefill_region.", "prfaas.decode_region."  # the callers' modules, by role


def _stamp(wall_first: bool) -> tuple[float, float, float, int, int]:
    """(monotonic s, CPU s, run-queue s, voluntary and involuntary switches) of this thread. The
    wall clock is read first at the start and last at the end, so its interval holds the others'."""
    import time

    wall = time.monotonic() if wall_first else 0.0
    with open("/proc/thread-self/schedstat") as f:
        cpu_ns, runq_ns, _slices = f.read().split()
    with open("/proc/thread-self/status") as f:
        counts = {k: int(v) for k, _, v in (line.partition(":") for line in f) if k.endswith("ctxt_switches")}
    wall = wall if wall_first else time.monotonic()
    return (wall, int(cpu_ns) / 1e9, int(runq_ns) / 1e9, counts["voluntary_ctxt_switches"],
            counts["nonvoluntary_ctxt_switches"])  # fmt: skip


def _path(caller: str) -> str:
    """Which role's backend called the forward, by the caller's module (its frame's `__name__`)."""
    if caller.startswith(SPLIT):
        return "split"
    return "local" if caller.startswith(LOCAL) else "other"


def _install(path: str) -> None:
    import functools
    import json

    from prfaas.engine.hf import HFEngine

    prefill = HFEngine.prefill

    @functools.wraps(prefill)
    def traced(self, token_ids, params, **kwargs):
        caller = sys._getframe(1).f_globals.get("__name__", "")
        a = _stamp(wall_first=True)
        try:
            return prefill(self, token_ids, params, **kwargs)
        finally:
            b = _stamp(wall_first=False)
            row = {
                "pid": os.getpid(), "tokens": len(token_ids), "path": _path(caller),
                "tapped": kwargs.get("on_layer") is not None,
                "wall_s": b[0] - a[0], "cpu_s": b[1] - a[1], "runq_s": b[2] - a[2],
                "blocked_s": max(0.0, (b[0] - a[0]) - (b[1] - a[1]) - (b[2] - a[2])),  # clock skew: see above
                "switches": [b[3] - a[3], b[4] - a[4]],
            }  # fmt: skip
            with open(path, "a") as out:
                out.write(json.dumps(row) + "\n")

    HFEngine.prefill = traced  # type: ignore[method-assign]


if os.environ.get("PRFAAS_FORWARD_TRACE") and "region" in sys.argv[1:3]:
    _install(os.environ["PRFAAS_FORWARD_TRACE"])
