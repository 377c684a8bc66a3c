"""An emulated WAN link between two network namespaces, for the benches (needs root).

    from prfaas.devstack.wanlink import PROFILES, wan_link
    with wan_link(*PROFILES["continental"]) as link:
        srv = link.run_in("b", ["python3", "server.py", "--host", link.addr_b])
        link.run_in("a", ["python3", "client.py", link.addr_b]).wait()

Two namespaces joined by the userspace emulator (`netns.py`: linkemu over two TUN devices,
one-way delay, rate limit, random loss, drop-tail queue, per direction), each end renamed
`wan0`. `bench/wan_selftest.py` measures the link itself (TCP goodput, ping). `cut()` /
`restore()` take the link down and up again (an outage: every packet dropped both ways).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from prfaas.devstack.netns import add_namespace, attach_tun, linkemu_argv, remove_namespaces, start_linkemu, stop

PROFILES = {  # name: (rtt_ms, rate_mbit, loss_pct)
    "continental": (40.0, 300.0, 0.01),
    "intercontinental": (80.0, 300.0, 0.1),
    "ceiling": (0.0, 0.0, 0.0),  # no delay, no rate limit, no loss: emulator CPU ceiling
}
_seq = itertools.count()


def _parse_counters(lines: list[str]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for line in lines:
        parts = line.split()
        if parts and parts[0] in ("a->b", "b->a"):
            out[parts[0]] = {k: int(v) for k, v in (p.split("=", 1) for p in parts[1:])}
    return out


@dataclass
class WanLink:
    ns_a: str
    ns_b: str
    addr_a: str
    addr_b: str
    dev: str
    rtt_ms: float
    rate_mbit: float
    loss_pct: float
    mtu: int
    queue_bytes: int | None
    emulator: subprocess.Popen[str]
    final_counters: dict[str, dict[str, int]] = field(default_factory=dict)
    _procs: list[subprocess.Popen[Any]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def _ns(self, ns: str) -> str:
        return {"a": self.ns_a, "b": self.ns_b}.get(ns, ns)

    def run_in(self, ns: str, argv: list[str], **popen_kwargs: Any) -> subprocess.Popen[Any]:
        """Start argv inside namespace ns ("a", "b" or a full name); killed on link exit."""
        p = subprocess.Popen(["ip", "netns", "exec", self._ns(ns), *argv], **popen_kwargs)
        self._procs.append(p)
        return p

    def check_in(self, ns: str, argv: list[str], timeout: float | None = None) -> str:
        """Run argv inside ns to completion; return stdout (raises on failure)."""
        return subprocess.run(
            ["ip", "netns", "exec", self._ns(ns), *argv], check=True, capture_output=True, text=True, timeout=timeout
        ).stdout

    def sysctl(self, key: str, value: str, ns: str | None = None) -> None:
        """Set a per-namespace sysctl in ns, or in both namespaces when ns is None."""
        for n in [self._ns(ns)] if ns else [self.ns_a, self.ns_b]:
            self.check_in(n, ["sysctl", "-q", "-w", f"{key}={value}"])

    def read_sysctl(self, key: str, ns: str = "a") -> str:
        return self.check_in(ns, ["sysctl", "-n", key]).strip().replace("\t", " ")

    def cut(self) -> float:
        """Cut the link now: every packet is dropped both ways, also those already on the wire,
        until `restore` (no RST, no ICMP: both ends see only silence). Returns time.monotonic()."""
        self.emulator.send_signal(signal.SIGRTMIN)
        return time.monotonic()

    def restore(self) -> float:
        """End a `cut`; packets flow again from now on. Returns time.monotonic()."""
        self.emulator.send_signal(signal.SIGRTMIN + 1)
        return time.monotonic()

    def slow(self) -> float:
        """Slow the link to 1/10 of its rate, both ways (a degraded path), until `unslow`.
        Returns time.monotonic()."""
        self.emulator.send_signal(signal.SIGRTMIN + 2)
        return time.monotonic()

    def unslow(self) -> float:
        """Give a `slow` link its rate back. Returns time.monotonic()."""
        self.emulator.send_signal(signal.SIGRTMIN + 3)
        return time.monotonic()

    def counters(self) -> dict[str, dict[str, int]]:
        """Live emulator counters per direction (SIGUSR1 makes linkemu print them)."""
        with self._lock:
            self.emulator.send_signal(signal.SIGUSR1)
            assert self.emulator.stdout is not None
            lines = [self.emulator.stdout.readline() for _ in range(3)]  # "stats", a->b, b->a
            return _parse_counters(lines)


@contextlib.contextmanager
def wan_link(
    rtt_ms: float,
    rate_mbit: float,
    loss_pct: float,
    mtu: int = 1500,
    queue_bytes: int | None = None,
    name_prefix: str = "pfw",
    seed: int = 1,
    addr_a: str = "10.77.0.1",
    addr_b: str = "10.77.0.2",
    txqueuelen: int = 5000,
    emulator_nice: int = -10,
    emulator_rt_prio: int | None = None,
    emulator_args: tuple[str, ...] = (),
) -> Iterator[WanLink]:
    """Two namespaces joined by linkemu; rtt_ms is split evenly between directions.

    rate_mbit=0 means unlimited; queue_bytes=None uses the emulator default (1.5 x BDP).
    txqueuelen sizes the TUN devices' own packet ring in front of the emulator: the default
    500 overflows when the emulator thread is briefly descheduled (seen on 2 cores).
    emulator_nice: the emulator plays the network, so it should not queue behind the endpoints;
    emulator_rt_prio runs it SCHED_FIFO instead (tighter timing on a busy host).
    emulator_args go to linkemu as is, e.g. ("--rate-mbit-ba", "50") for an asymmetric link.
    Everything (processes from run_in, emulator, namespaces) is removed on exit, also on
    exceptions and KeyboardInterrupt.
    """
    if os.geteuid() != 0:
        raise PermissionError("wan_link needs root (netns, TUN devices)")
    n = next(_seq)
    tag = f"{os.getpid()}-{n}"
    ns_a, ns_b = f"{name_prefix}-{tag}-a", f"{name_prefix}-{tag}-b"
    tun_a, tun_b = (f"{name_prefix[:3]}{os.getpid()}x{n}{s}"[-15:] for s in "ab")
    created: list[str] = []
    emu: subprocess.Popen[str] | None = None
    link: WanLink | None = None
    try:
        for ns in (ns_a, ns_b):
            add_namespace(ns)
            created.append(ns)
        argv = linkemu_argv(tun_a, tun_b, rtt_ms=rtt_ms, rate_mbit=rate_mbit, loss_pct=loss_pct, seed=seed,
                            queue_bytes=queue_bytes, nice=emulator_nice, rt_prio=emulator_rt_prio,
                            extra=emulator_args)  # fmt: skip
        emu = start_linkemu(argv)
        for ns, tun, addr in ((ns_a, tun_a, addr_a), (ns_b, tun_b, addr_b)):
            attach_tun(tun, ns, "wan0", f"{addr}/30", mtu=mtu, txqueuelen=txqueuelen)
        link = WanLink(ns_a, ns_b, addr_a, addr_b, "wan0", rtt_ms, rate_mbit, loss_pct, mtu, queue_bytes, emu)
        yield link
    finally:
        if link is not None:
            for p in link._procs:
                stop(p, wait_s=2.0)
        if emu is not None:
            stop(emu)
            if link is not None and emu.stdout is not None:
                link.final_counters = _parse_counters(emu.stdout.read().splitlines())
        remove_namespaces(created)  # also kills anything else still running inside them
