"""Where `prfaas up` puts each region on the network.

`LoopbackNetwork`: every process on 127.0.0.1 (the default).

`WanMesh` (`--emulate-wan`, root): one network namespace per region. Control traffic (the
API and Celery worker calling regions, regions' heartbeats to the registry) crosses a Linux
bridge in the root namespace, unshaped: `10.79.S.1` is the root side (the registry listens
there), `10.79.S.(i+1)` region i. KV traffic crosses one userspace link emulator
(`netns.py`: linkemu, the emulator the benches' `wanlink.wan_link` drives too) per topology link, with that link's
RTT (split evenly between directions), rate and loss, both ways: region i's KV port listens on
its own address `10.78.S.i` (on `lo`), which other namespaces reach only through an emulated
link (`10.77.j.1` <-> `10.77.j.2`, /30, device `wanj`). A pair without a link cannot ship KV.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Protocol

from prfaas.devstack.netns import add_namespace, attach_tun, ip, linkemu_argv, start_linkemu
from prfaas.devstack.topology import Topology

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
        bridge = f"{self.tag}br"[-15:]
        ip("link", "add", bridge, "type", "bridge")
        self.devices.append(bridge)
        ip("addr", "add", f"{self.registry_host}/24", "dev", bridge)
        ip("link", "set", bridge, "up")
        for name, i in self.index.items():
            ns = self._ns(name)
            add_namespace(ns, WAN_SYSCTLS)
            self.namespaces.append(ns)
            host_end, ns_end = f"{self.tag}h{i}"[-15:], f"{self.tag}n{i}"[-15:]
            ip("link", "add", host_end, "type", "veth", "peer", "name", ns_end)
            ip("link", "set", host_end, "master", bridge, "up")
            ip("link", "set", ns_end, "netns", ns)
            ip("-n", ns, "link", "set", ns_end, "name", "cp0")
            ip("-n", ns, "addr", "add", f"10.79.{self.subnet}.{i + 1}/24", "dev", "cp0")
            ip("-n", ns, "link", "set", "cp0", "up")
            ip("-n", ns, "addr", "add", f"10.78.{self.subnet}.{i}/32", "dev", "lo")
        pairs: set[frozenset[str]] = set()
        for j, link in enumerate(self.topology.links, start=1):
            if frozenset((link.src, link.dst)) in pairs:
                continue  # the reverse direction already has an emulated path
            pairs.add(frozenset((link.src, link.dst)))
            self._link(j, link.src, link.dst, link.rtt_ms, link.rate_mbit, link.loss_pct)

    def _link(self, j: int, src: str, dst: str, rtt_ms: float, rate_mbit: float, loss: float) -> None:
        tun_a, tun_b = f"{self.tag}t{j}a"[-15:], f"{self.tag}t{j}b"[-15:]
        argv = linkemu_argv(tun_a, tun_b, rtt_ms=rtt_ms, rate_mbit=rate_mbit, loss_pct=loss, seed=j, nice=-10)
        try:
            proc = start_linkemu(argv, log=self.run_dir / f"linkemu-{j}.log")
        except OSError as exc:
            raise OSError(f"link {src} -> {dst}: {exc}") from None
        self.groups[f"linkemu-{j}"] = proc.pid
        ends = ((src, tun_a, f"10.77.{j}.1", dst, f"10.77.{j}.2"), (dst, tun_b, f"10.77.{j}.2", src, f"10.77.{j}.1"))
        for name, tun, addr, peer, peer_addr in ends:
            ns = self._ns(name)
            attach_tun(tun, ns, f"wan{j}", f"{addr}/30")
            ip("-n", ns, "route", "add", f"10.78.{self.subnet}.{self.index[peer]}/32", "via", peer_addr)

    def region_listen(self, name: str) -> tuple[str, str]:
        i = self.index[name]
        return f"10.79.{self.subnet}.{i + 1}:0", f"10.78.{self.subnet}.{i}:0"

    def argv_prefix(self, name: str) -> list[str]:
        return ["ip", "netns", "exec", self._ns(name)]
