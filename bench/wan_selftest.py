"""The emulated WAN link itself (devstack/wanlink.py), measured: ping RTT and bulk TCP goodput
for stream counts x congestion controls x socket buffer modes, with the emulator's own
counters (drops, how late it released packets). Needs root.

    sudo .venv/bin/python bench/wan_selftest.py --profile continental --selftest
    sudo .venv/bin/python bench/wan_selftest.py --rtt-ms 40 --rate-mbit 300 --loss-pct 0.01 --selftest
    sudo .venv/bin/python bench/wan_selftest.py --profile continental     # hold the link up until Ctrl-C
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from prfaas.bench.wan_roles import ROLES
from prfaas.devstack.wanlink import PROFILES, WanLink, wan_link
from prfaas.loadgen.report import percentile

# ---------------------------------------------------------------- selftest driver


def ping(link: WanLink, count: int = 5) -> list[float]:
    out = link.check_in(
        "a",
        [
            sys.executable,
            str(Path(__file__).resolve()),
            "--_role",
            "ping",
            "--host",
            link.addr_b,
            "--count",
            str(count),
        ],
        timeout=30,
    )
    rtts: list[float] = json.loads(out.splitlines()[-1])["rtts_ms"]
    return rtts


_port = itertools.count(5201)


def _link_rates(samples: list[tuple[float, int]], t0: float, t1: float) -> tuple[float, float]:
    """(Mbit/s over the 2nd half of [t0, t1], max Mbit/s over any >=1 s window) of IP bytes."""
    inside = [(t, b) for t, b in samples if t0 <= t <= t1]
    half = [(t, b) for t, b in inside if t >= (t0 + t1) / 2]
    second = 0.0
    if len(half) > 1 and half[-1][0] > half[0][0]:
        second = (half[-1][1] - half[0][1]) * 8 / (half[-1][0] - half[0][0]) / 1e6
    peak = 0.0
    for i, (ti, bi) in enumerate(inside):
        for tj, bj in inside[i + 1 :]:
            if tj - ti >= 1.0:
                peak = max(peak, (bj - bi) * 8 / (tj - ti) / 1e6)
                break
    return second, peak


def bulk_tcp(
    link: WanLink, streams: int = 1, cc: str = "cubic", buf: int = 0, duration: float = 10.0, nbytes: int = 200 * 10**6
) -> dict[str, Any]:
    """Bulk TCP a -> b. Goodput is timed on the receiver (first byte -> nbytes or duration);
    link_* figures come from the emulator's a->b counters (IP bytes, retransmissions included).
    buf > 0 forces SO_SNDBUF/SO_RCVBUF to that size (autotuning off)."""
    me = [sys.executable, str(Path(__file__).resolve())]
    common = [
        "--host",
        link.addr_b,
        "--port",
        str(next(_port)),
        "--streams",
        str(streams),
        "--cc",
        cc,
        "--buf",
        str(buf),
        "--duration",
        str(duration),
        "--bytes",
        str(nbytes),
    ]
    samples: list[tuple[float, int]] = []
    late_max = [0]
    done = threading.Event()

    def poll() -> None:  # emulator counters every 0.1 s, stamped by the emulator itself
        while not done.wait(0.1):
            c = link.counters().get("a->b")
            if c:
                samples.append((c["t_ns"] / 1e9, c["tx_bytes"]))
                late_max[0] = max(late_max[0], c["late_max_ns"])

    before = link.counters()
    rx = link.run_in("b", [*me, "--_role", "recv", *common], stdout=subprocess.PIPE, text=True)
    assert rx.stdout is not None
    if rx.stdout.readline().strip() != "listening":
        raise RuntimeError("receiver failed to start")
    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    try:
        tx = link.run_in("a", [*me, "--_role", "send", *common], stdout=subprocess.PIPE, text=True)
        r_out, _ = rx.communicate(timeout=duration + 30)
        s_out, _ = tx.communicate(timeout=30)
    finally:
        done.set()
        poller.join()
    after = link.counters()
    res: dict[str, Any] = json.loads(r_out.splitlines()[-1])
    res.update(json.loads(s_out.splitlines()[-1]) if s_out.strip() else {})
    ab, ab0 = after.get("a->b", {}), before.get("a->b", {})
    for k in ("drop_loss", "drop_queue", "drop_buf", "tx_pkts", "late_sum_ns", "late_1ms"):
        res[f"emu_{k}"] = ab.get(k, 0) - ab0.get(k, 0)
    late_max[0] = max(late_max[0], ab.get("late_max_ns", 0))
    pk = max(res["emu_tx_pkts"], 1)
    # how late the emulator released a->b packets vs their schedule (delay accuracy)
    res["late_avg_us"], res["late_max_ms"] = res["emu_late_sum_ns"] / pk / 1e3, late_max[0] / 1e6
    res["late_1ms_pct"] = 100 * res["emu_late_1ms"] / pk
    res["link_mbit_2nd_half"], res["link_mbit_max_1s"] = _link_rates(samples, res["t0"], res["t1"])
    time.sleep(0.5)  # let the delay line drain before the next run
    return res


def _num(value: float | None, width: int, digits: int) -> str:
    return f"{value:>{width}.{digits}f}" if value is not None else f"{'-':>{width}}"


def bbr_available() -> bool:
    avail = Path("/proc/sys/net/ipv4/tcp_available_congestion_control")
    if "bbr" in avail.read_text().split():
        return True
    subprocess.run(["modprobe", "tcp_bbr"], capture_output=True, check=False)
    return "bbr" in avail.read_text().split()


BUF_MODES = {  # name: (tcp_rmem/tcp_wmem max set in both namespaces or None, forced SO_*BUF)
    "default": (None, 0),
    "sysctl64m": (64 << 20, 0),
    "sockopt32m": (None, 32 << 20),
}


def selftest(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    ccs = [c for c in args.cc.split(",") if c]
    if "bbr" in ccs and not bbr_available():
        print("# bbr unavailable (not in tcp_available_congestion_control, modprobe tcp_bbr failed); skipped")
        ccs.remove("bbr")
    with wan_link(
        args.rtt_ms,
        args.rate_mbit,
        args.loss_pct,
        mtu=args.mtu,
        queue_bytes=args.queue_bytes,
        emulator_rt_prio=args.rt_prio,
    ) as link:
        rtts = ping(link, 5)
        ping_med = percentile(rtts, 50)  # None (JSON null) when no ping came back
        print("# host loadavg at start: " + " ".join(f"{x:.2f}" for x in os.getloadavg()))
        print(
            f"# link rtt={args.rtt_ms} ms rate={args.rate_mbit or 'unlimited'} Mbit/s "
            f"loss={args.loss_pct}% mtu={args.mtu} ns={link.ns_a},{link.ns_b}"
        )
        print(f"# ping {link.addr_a} -> {link.addr_b}: " + " ".join(f"{r:.2f}" for r in rtts) + " ms")
        orig = {k: link.read_sysctl(k) for k in ("net.ipv4.tcp_rmem", "net.ipv4.tcp_wmem")}
        print(f"# namespace defaults: tcp_rmem='{orig['net.ipv4.tcp_rmem']}' tcp_wmem='{orig['net.ipv4.tcp_wmem']}'")
        hdr = (
            f"{'bufs':<10} {'cc':<5} {'str':>3} {'ping_ms':>7} {'srtt_ms':>7} {'goodput':>8} {'ratio':>6} "
            f"{'link2nd':>7} {'linkmax':>7} {'retrans':>7} {'q_drop':>6} {'l_drop':>6} {'late_us':>7} {'late_mx':>7} "
            f"{'secs':>5}"
        )
        print(hdr, flush=True)
        for mode in args.bufs.split(","):
            sysmax, force = BUF_MODES[mode]
            for k, v in orig.items():
                lo, mid, _ = v.split()
                link.sysctl(k, f"{lo} {mid} {sysmax}" if sysmax else v)
            for cc in ccs:
                for n in [int(x) for x in args.streams.split(",")]:
                    r = bulk_tcp(link, n, cc, force, args.duration, args.bytes)
                    ratio = r["mbit"] / args.rate_mbit if args.rate_mbit else None  # unlimited link: no ratio
                    row = {
                        "profile": args.profile,
                        "rtt_ms": args.rtt_ms,
                        "rate_mbit": args.rate_mbit,
                        "loss_pct": args.loss_pct,
                        "mtu": args.mtu,
                        "bufs": mode,
                        "cc": cc,
                        "streams": n,
                        "ping_ms": ping_med,
                        "ratio": ratio,
                        **r,
                    }
                    rows.append(row)
                    print(
                        f"{mode:<10} {cc:<5} {n:>3} {_num(row['ping_ms'], 7, 2)} {r.get('srtt_ms', 0):>7.1f} "
                        f"{r['mbit']:>8.1f} {_num(ratio, 6, 3)} {r['link_mbit_2nd_half']:>7.1f} "
                        f"{r['link_mbit_max_1s']:>7.1f} {r.get('retrans', 0):>7} {r['emu_drop_queue']:>6} "
                        f"{r['emu_drop_loss']:>6} {r['late_avg_us']:>7.0f} {r['late_max_ms']:>7.2f} "
                        f"{r['seconds']:>5.1f}",
                        flush=True,
                    )
    print("# host loadavg at end: " + " ".join(f"{x:.2f}" for x in os.getloadavg()))
    print(f"# emulator totals: {json.dumps(link.final_counters)}")
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", choices=sorted(PROFILES))
    p.add_argument("--rtt-ms", type=float)
    p.add_argument("--rate-mbit", type=float)
    p.add_argument("--loss-pct", type=float)
    p.add_argument("--mtu", type=int, default=1500)
    p.add_argument("--queue-bytes", type=int)
    p.add_argument("--selftest", action="store_true")
    p.add_argument("--streams", default="1,4", help="comma list (selftest)")
    p.add_argument("--cc", default="cubic,bbr", help="comma list (selftest)")
    p.add_argument("--bufs", default="default,sysctl64m", help=f"comma list of {','.join(BUF_MODES)}")
    p.add_argument("--duration", type=float, default=10.0, help="max seconds per transfer")
    p.add_argument("--bytes", type=int, default=200 * 10**6, help="max bytes per transfer")
    p.add_argument("--json", help="also write the rows to this file")
    p.add_argument("--rt-prio", type=int, help="run the emulator SCHED_FIFO at this priority")
    # internal roles (run inside a namespace)
    p.add_argument("--_role", choices=["recv", "send", "ping"], help=argparse.SUPPRESS)
    p.add_argument("--host", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--buf", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--count", type=int, default=5, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a._role:
        if a._role in ("recv", "send"):
            a.streams = int(a.streams)
        ROLES[a._role](a)
        return 0
    prof = PROFILES.get(a.profile, (0.0, 0.0, 0.0))
    a.rtt_ms = prof[0] if a.rtt_ms is None else a.rtt_ms
    a.rate_mbit = prof[1] if a.rate_mbit is None else a.rate_mbit
    a.loss_pct = prof[2] if a.loss_pct is None else a.loss_pct

    def on_term(signum: int, frame: object) -> None:  # make SIGTERM unwind like Ctrl-C so cleanup runs
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even if started with SIGINT ignored
    if not a.selftest:
        with wan_link(
            a.rtt_ms, a.rate_mbit, a.loss_pct, mtu=a.mtu, queue_bytes=a.queue_bytes, emulator_rt_prio=a.rt_prio
        ) as link:
            print(f"link up: {link.ns_a} {link.addr_a} <-> {link.ns_b} {link.addr_b}; Ctrl-C to stop", flush=True)
            with contextlib.suppress(KeyboardInterrupt):
                while True:
                    time.sleep(3600)
        print(f"emulator counters: {json.dumps(link.final_counters)}")
        return 0
    try:
        rows = selftest(a)
    except KeyboardInterrupt:
        print("interrupted; link removed", file=sys.stderr)
        return 130
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
