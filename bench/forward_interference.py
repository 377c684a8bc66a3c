"""Does moving a split job's KV bytes on one vCPU slow a 2,048-token forward on the other?

    .venv/bin/python bench/forward_interference.py --pairs 8 --json out.json

The forward (SmolLM2-135M fp32, the HF engine, one torch thread) is pinned to CPU 0 and run
in pairs: alone, then while a helper process pinned to CPU 1 pushes `--mbytes` MB through a
loopback TCP socket at `--rate-mb-s` (78.6 MB at 10.8 MB/s is issue 7's lossless shipment of
a 2,048-token prompt spread over a ~7.3 s forward): one copy out of a source buffer, the
kernel's send and receive copies, and a `recv_into` a preallocated buffer. That is less than
any real shipment does (no codec, no framing, no link emulator), so the slowdown it causes is a
floor for what the split forward pays on this host. Both figures come from the same run;
within a pair the order alternates (even pairs: alone first, odd pairs: with the pump first;
each pair records its `order`), so that host drift and whatever the previous forward left in
the caches land on both.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

FORWARD_CPU, PUMP_CPU = 0, 1


def pump(total: int, rate: float) -> None:
    """Push `total` bytes through a loopback socket at `rate` bytes/s, on PUMP_CPU."""
    os.sched_setaffinity(0, {PUMP_CPU})
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(30)

    def receive() -> None:
        conn, _ = server.accept()
        conn.settimeout(60)
        view = memoryview(bytearray(total))
        got = 0
        while got < total:
            n = conn.recv_into(view[got:], min(1 << 20, total - got))
            if not n:
                break
            got += n

    reader = threading.Thread(target=receive)
    reader.start()
    client = socket.create_connection(server.getsockname(), timeout=30)
    source = os.urandom(3 << 20)  # a "layer" to copy from
    chunk, sent, start = 1 << 16, 0, time.monotonic()
    while sent < total:
        n = min(chunk, total - sent)
        offset = sent % (len(source) - chunk)
        client.sendall(source[offset : offset + n])
        sent += n
        ahead = sent / rate - (time.monotonic() - start)
        if ahead > 0:
            time.sleep(ahead)
    client.close()
    reader.join(60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--mbytes", type=float, default=78.6, help="bytes moved during each loaded forward, MB")
    parser.add_argument("--rate-mb-s", type=float, default=10.8)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--json", help="write the pairs and medians here")
    args = parser.parse_args()
    if args.pairs < 1:
        parser.error(f"--pairs {args.pairs}: at least 1")
    if len(os.sched_getaffinity(0) | {FORWARD_CPU, PUMP_CPU}) > len(os.sched_getaffinity(0)):
        sys.exit(f"needs CPUs {FORWARD_CPU} and {PUMP_CPU}")

    os.sched_setaffinity(0, {FORWARD_CPU})
    import torch
    from transformers import DynamicCache

    from prfaas.engine.hf import HFEngine

    torch.set_num_threads(1)
    engine = HFEngine(args.model)
    ids = [int(t) for t in torch.randint(100, 40_000, (args.tokens,), generator=torch.Generator().manual_seed(1))]

    def forward() -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            engine._forward(ids, DynamicCache())
        return time.perf_counter() - start

    forward()  # warm-up
    total, rate = int(args.mbytes * 1e6), args.rate_mb_s * 1e6

    def with_pump() -> float:
        helper = subprocess.Popen([sys.executable, __file__, "--pump", str(total), str(rate)])
        time.sleep(0.2)  # connected and sending
        seconds = forward()
        if helper.wait(timeout=120) != 0:
            sys.exit("the pump failed")
        return seconds

    rows: list[dict[str, Any]] = []  # {alone_s, with_pump_s, order}
    for i in range(args.pairs):
        order = "alone-first" if i % 2 == 0 else "pump-first"
        if order == "alone-first":
            alone = forward()
            loaded = with_pump()
        else:
            loaded = with_pump()
            alone = forward()
        rows.append({"alone_s": alone, "with_pump_s": loaded, "order": order})
        print(f"pair {i} ({order}): alone {alone:.3f} s, with the pump {loaded:.3f} s "
              f"({1000 * (loaded - alone):+.0f} ms)")  # fmt: skip
    alone_s = [r["alone_s"] for r in rows]
    loaded_s = [r["with_pump_s"] for r in rows]
    diffs = [1000 * (b - a) for a, b in zip(alone_s, loaded_s, strict=True)]
    summary = {
        "alone_median_s": statistics.median(alone_s), "with_pump_median_s": statistics.median(loaded_s),
        "pairwise_median_ms": statistics.median(diffs), "alone_min_s": min(alone_s), "alone_max_s": max(alone_s),
        "mbytes": args.mbytes, "rate_mb_s": args.rate_mb_s, "pairs": rows,
    }  # fmt: skip
    print(
        f"forward alone median {summary['alone_median_s']:.3f} s (range {min(alone_s):.3f}-{max(alone_s):.3f}), "
        f"with the pump {summary['with_pump_median_s']:.3f} s; pairwise median {summary['pairwise_median_ms']:+.0f} ms"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--pump"]:
        pump(int(sys.argv[2]), float(sys.argv[3]))
    else:
        main()
