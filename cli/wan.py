"""Where `prfaas up` puts each region on the network.

`LoopbackNetwork`: every process on 127.0.0.1 (the default).

`WanMesh` (`--emulate-wan`, root): one network namespace per region. Control traffic (the
API and Celery worker calling regions, regions' heartbeats to the registry) crosses a Linux
bridge in the root namespace, unshaped: `10.79.S.1` is the root side (the registry listens
there), `10.79.S.(i+1)` region i. KV traffic crosses one userspace link emulator
(bench/linkemu, the same one bench/wan_netns.py drives) per topology link, with that link's
RTT (split evenly between directions), rate and loss, both ways: region i's KV port listens on
its own address `10.78.S.i` (on `lo`), which other namespaces reach only through an emulated
link (`10.77.j.1` <-> `10.77.j.2`, /30, device `wanj`). A pair without a link cannot ship KV.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from prfaas.cli.topology import Topology

WAN_SYSCTLS = {"net.ipv4.tcp_rmem": "4096 131072 67108864", "net.ipv4.tcp_wmem": "4096 16384 67108864"}


class Network(Protocol):
    namespaces: list[str]
    devices: list[str]  # interfaces in the root namespace to delete at the end
    groups: dict[str, int]  # helper processes (link emulators): name -> process group
    registry_host: str

    def setup(self) -> None: ...

    def region_listen(self, name: str) -> tuple[str, str]:
        """(gRPC listen, KV listen) host:port of a region; port 0 picks a free one."""
        ...

    def argv_prefix(self, name: str) -> list[str]: ...


class LoopbackNetwork:
    def __init__(self) -> None:
        self.namespaces: list[str] = []
        self.devices: list[str] = []
        self.groups: dict[str, int] = {}
        self.registry_host = "127.0.0.1"

    def setup(self) -> None:
        pass

    def region_listen(self, name: str) -> tuple[str, str]:
        return "127.0.0.1:0", "127.0.0.1:0"

    def argv_prefix(self, name: str) -> list[str]:
        return []


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10, check=False)
    if check and out.returncode != 0:
        raise OSError(f"ip {' '.join(args)}: {out.stderr.strip()}")
    return out


class WanMesh:
    def __init__(self, topology: Topology, run_dir: Path) -> None:
        self.topology = topology
        self.run_dir = run_dir
        pid = os.getpid()
        self.tag = f"pu{pid}"
        self.subnet = pid % 250 + 1  # the third octet: two meshes on one host rarely collide
        self.index = {r.name: i + 1 for i, r in enumerate(topology.regions)}
        self.namespaces: list[str] = []
        self.devices: list[str] = []
        self.groups: dict[str, int] = {}
        self.registry_host = f"10.79.{self.subnet}.1"

    def _ns(self, name: str) -> str:
        return f"{self.tag}-{self.index[name]}"

    def setup(self) -> None:
        if os.geteuid() != 0:
            raise PermissionError("--emulate-wan needs root (network namespaces, TUN devices)")
        from prfaas.bench.wan_netns import build_linkemu

        binary = build_linkemu()
        bridge = f"{self.tag}br"[-15:]
        _ip("link", "add", bridge, "type", "bridge")
        self.devices.append(bridge)
        _ip("addr", "add", f"{self.registry_host}/24", "dev", bridge)
        _ip("link", "set", bridge, "up")
        for name, i in self.index.items():
            ns = self._ns(name)
            _ip("netns", "add", ns)
            self.namespaces.append(ns)
            host_end, ns_end = f"{self.tag}h{i}"[-15:], f"{self.tag}n{i}"[-15:]
            _ip("link", "add", host_end, "type", "veth", "peer", "name", ns_end)
            _ip("link", "set", host_end, "master", bridge, "up")
            _ip("link", "set", ns_end, "netns", ns)
            _ip("-n", ns, "link", "set", ns_end, "name", "cp0")
            _ip("-n", ns, "addr", "add", f"10.79.{self.subnet}.{i + 1}/24", "dev", "cp0")
            _ip("-n", ns, "link", "set", "cp0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "addr", "add", f"10.78.{self.subnet}.{i}/32", "dev", "lo")
            for key, value in WAN_SYSCTLS.items():
                subprocess.run(["ip", "netns", "exec", ns, "sysctl", "-q", "-w", f"{key}={value}"], check=True,
                               capture_output=True, timeout=10)  # fmt: skip
        pairs: set[frozenset[str]] = set()
        for j, link in enumerate(self.topology.links, start=1):
            if frozenset((link.src, link.dst)) in pairs:
                continue  # the reverse direction already has an emulated path
            pairs.add(frozenset((link.src, link.dst)))
            self._link(binary, j, link.src, link.dst, link.rtt_ms, link.rate_mbit, link.loss_pct)

    def _link(self, binary: Path, j: int, src: str, dst: str, rtt_ms: float, rate_mbit: float, loss: float) -> None:
        tun_a, tun_b = f"{self.tag}t{j}a"[-15:], f"{self.tag}t{j}b"[-15:]
        log = self.run_dir / f"linkemu-{j}.log"
        argv = [str(binary), "--tun-a", tun_a, "--tun-b", tun_b, "--delay-ms", str(rtt_ms / 2),
                "--rate-mbit", str(rate_mbit), "--loss-pct", str(loss), "--seed", str(j), "--nice", "-10"]  # fmt: skip
        with log.open("w") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self.groups[f"linkemu-{j}"] = proc.pid
        deadline = time.monotonic() + 10
        while not log.read_text().startswith("ready") and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        if not log.read_text().startswith("ready"):
            raise OSError(f"linkemu for {src} -> {dst} did not start: {log.read_text()!r}")
        ends = ((src, tun_a, f"10.77.{j}.1", dst, f"10.77.{j}.2"), (dst, tun_b, f"10.77.{j}.2", src, f"10.77.{j}.1"))
        for name, tun, addr, peer, peer_addr in ends:
            ns = self._ns(name)
            _ip("link", "set", tun, "netns", ns)
            _ip("-n", ns, "link", "set", tun, "name", f"wan{j}")
            _ip("-n", ns, "addr", "add", f"{addr}/30", "dev", f"wan{j}")
            _ip("-n", ns, "link", "set", f"wan{j}", "mtu", "1500", "txqueuelen", "5000", "up")
            _ip("-n", ns, "route", "add", f"10.78.{self.subnet}.{self.index[peer]}/32", "via", peer_addr)

    def region_listen(self, name: str) -> tuple[str, str]:
        i = self.index[name]
        return f"10.79.{self.subnet}.{i + 1}:0", f"10.78.{self.subnet}.{i}:0"

    def argv_prefix(self, name: str) -> list[str]:
        return ["ip", "netns", "exec", self._ns(name)]


def remove_namespaces(namespaces: Sequence[str], devices: Sequence[str] = ()) -> None:
    """Kill whatever still runs in each namespace, delete it, then the root-side devices."""
    for ns in namespaces:
        for pid in _ip("netns", "pids", ns, check=False).stdout.split():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
        _ip("netns", "del", ns, check=False)
    for device in devices:
        _ip("link", "del", device, check=False)
