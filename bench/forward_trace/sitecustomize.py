"""Where each forward's wall time went, inside every region process of a benchmark run (Linux).

    PYTHONPATH=$PWD/bench/forward_trace PRFAAS_FORWARD_TRACE=/tmp/fwd.jsonl prfaas up ...

Python imports this file at start-up (it is `sitecustomize` on PYTHONPATH). In a region
process with PRFAAS_FORWARD_TRACE set, it wraps `HFEngine.prefill` and appends one JSON line
per forward: pid, tokens, tapped (true: a split job's forward, shipping each layer; false: a
local job's), and the calling thread's
    wall_s     monotonic clock around the forward
    cpu_s      the thread's time on a CPU (/proc/thread-self/schedstat, field 1)
    runq_s     time runnable but waiting for a core (field 2): other threads and processes
    blocked_s  the rest: waiting for the GIL, a lock or I/O
    switches   voluntary and involuntary context switches (/proc/thread-self/status)
Nothing changes for any other process, or when the variable is unset.
"""

from __future__ import annotations

import os
import sys


def _stamp() -> tuple[float, float, float, int, int]:
    import time

    with open("/proc/thread-self/schedstat") as f:
        cpu_ns, runq_ns, _slices = f.read().split()
    with open("/proc/thread-self/status") as f:
        counts = {k: int(v) for k, _, v in (line.partition(":") for line in f) if k.endswith("ctxt_switches")}
    return (time.monotonic(), int(cpu_ns) / 1e9, int(runq_ns) / 1e9, counts["voluntary_ctxt_switches"],
            counts["nonvoluntary_ctxt_switches"])  # fmt: skip


def _install(path: str) -> None:
    import functools
    import json

    from prfaas.engine.hf import HFEngine

    prefill = HFEngine.prefill

    @functools.wraps(prefill)
    def traced(self, token_ids, params, **kwargs):
        a = _stamp()
        try:
            return prefill(self, token_ids, params, **kwargs)
        finally:
            b = _stamp()
            row = {
                "pid": os.getpid(), "tokens": len(token_ids), "tapped": kwargs.get("on_layer") is not None,
                "wall_s": b[0] - a[0], "cpu_s": b[1] - a[1], "runq_s": b[2] - a[2],
                "blocked_s": (b[0] - a[0]) - (b[1] - a[1]) - (b[2] - a[2]),
                "switches": [b[3] - a[3], b[4] - a[4]],
            }  # fmt: skip
            with open(path, "a") as out:
                out.write(json.dumps(row) + "\n")

    HFEngine.prefill = traced  # type: ignore[method-assign]


if os.environ.get("PRFAAS_FORWARD_TRACE") and "region" in sys.argv[1:3]:
    _install(os.environ["PRFAAS_FORWARD_TRACE"])
