"""Where `prfaas up` puts each region instance on the network.

`LoopbackNetwork`: every process on 127.0.0.1 (the default).

`WanMesh` (`--emulate-wan`, root): every region instance in a network namespace of its own,
as if on a machine of its own, and each region a site behind its own router:

- control traffic (the API and Celery workers calling instances, instances' heartbeats to
  the registry, health watches between regions) crosses a Linux bridge in the root
  namespace, unshaped: `10.79.S.1` is the root side (the registry listens there), each
  instance's `cp0` has `10.79.S.n`;
- each region is a site: a router namespace whose bridge joins the region's instances
  (`kv0`: `10.(100+i).S.(k+2)`, where KV ports listen; a LAN, so a region's instances
  reach each other directly), and whose default route takes everything else;
- KV between regions crosses one userspace link emulator (`netns.py`: linkemu) per topology
  link, between the two sites' routers, with that link's RTT (split evenly between
  directions), rate and loss, both ways (`10.77.j.1` <-> `10.77.j.2`, /30, device `wanj`).
  A pair of regions without a link cannot ship KV.

S is a third octet picked from the process id, so two meshes on one host rarely collide.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from prfaas.devstack.netns import add_namespace, attach_tun, ip, linkemu_argv, start_linkemu
from prfaas.devstack.topology import Topology

WAN_SYSCTLS = {"net.ipv4.tcp_rmem": "4096 131072 67108864", "net.ipv4.tcp_wmem": "4096 16384 67108864"}
ROUTER_SYSCTLS = {"net.ipv4.ip_forward": "1"}


class Network(Protocol):
    namespaces: list[str]
    devices: list[str]  # interfaces in the root namespace to delete at the end
    groups: dict[str, int]  # helper processes (link emulators): name -> process group
    registry_host: str

    def setup(self, changed: Callable[[], None] | None = None) -> None:
        """Build it; `changed()` runs each time `namespaces`, `devices` or `groups` grows, before setup goes on
        (the caller writes them down: a process killed mid-setup leaves them to `prfaas down`)."""
        ...

    def instance_listen(self, region: str, k: int) -> tuple[str, str]:
        """(gRPC listen, KV listen) host:port of instance `k` (0-based) of `region`; port 0
        picks a free one."""
        ...

    def argv_prefix(self, region: str, k: int) -> list[str]: ...

    def link_emulator(self, src: str, dst: str) -> int | None: ...


class LoopbackNetwork:
    def __init__(self) -> None:
        self.namespaces: list[str] = []
        self.devices: list[str] = []
        self.groups: dict[str, int] = {}
        self.registry_host = "127.0.0.1"

    def setup(self, changed: Callable[[], None] | None = None) -> None:
        pass

    def instance_listen(self, region: str, k: int) -> tuple[str, str]:
        return "127.0.0.1:0", "127.0.0.1:0"

    def argv_prefix(self, region: str, k: int) -> list[str]:
        return []

    def link_emulator(self, src: str, dst: str) -> int | None:
        """The pid of the emulator of link `src -> dst` (None: not emulated)."""
        return None


class WanMesh:
    def __init__(self, topology: Topology, run_dir: Path, instances: dict[str, int] | None = None) -> None:
        """`instances`: how many instances each region runs (default: the topology's)."""
        self.topology = topology
        self.run_dir = run_dir
        pid = os.getpid()
        self.tag = f"pu{pid}"
        self.subnet = pid % 250 + 1
        self.index = {r.name: i + 1 for i, r in enumerate(topology.regions)}
        self.instances = instances or {r.name: r.instances for r in topology.regions}
        hosts = [(name, k) for name in self.index for k in range(self.instances[name])]
        self._host = {host: n + 2 for n, host in enumerate(hosts)}  # the last octet of each instance's cp0
        if len(hosts) > 250:
            raise ValueError(f"{len(hosts)} instances: at most 250 fit one emulated mesh")
        self.namespaces: list[str] = []
        self.devices: list[str] = []
        self.groups: dict[str, int] = {}
        self.registry_host = f"10.79.{self.subnet}.1"
        self._changed: Callable[[], None] = lambda: None

    def _ns(self, region: str, k: int) -> str:
        return f"{self.tag}-{self.index[region]}-{k}"

    def _site(self, region: str) -> str:
        return f"{self.tag}-s{self.index[region]}"

    def _lan(self, region: str) -> str:
        return f"10.{100 + self.index[region]}.{self.subnet}"

    def setup(self, changed: Callable[[], None] | None = None) -> None:
        if os.geteuid() != 0:
            raise PermissionError("--emulate-wan needs root (network namespaces, TUN devices)")
        self._changed = changed or (lambda: None)
        bridge = f"{self.tag}br"[-15:]
        self._name(self.devices, bridge)
        ip("link", "add", bridge, "type", "bridge")
        self._free_subnet()
        ip("addr", "add", f"{self.registry_host}/24", "dev", bridge)
        ip("link", "set", bridge, "up")
        for region in self.index:
            site = self._site(region)
            self._name(self.namespaces, site)
            add_namespace(site, ROUTER_SYSCTLS)
            ip("-n", site, "link", "add", "br0", "type", "bridge")
            ip("-n", site, "addr", "add", f"{self._lan(region)}.1/24", "dev", "br0")
            ip("-n", site, "link", "set", "br0", "up")
            for k in range(self.instances[region]):
                self._instance(region, k, bridge)
        pairs: set[frozenset[str]] = set()
        for j, link in enumerate(self.topology.links, start=1):
            if frozenset((link.src, link.dst)) in pairs:
                continue  # the reverse direction: the same emulator carries it, with its own figures
            pairs.add(frozenset((link.src, link.dst)))
            back = next((x for x in self.topology.links if (x.src, x.dst) == (link.dst, link.src)), None)
            extra = () if back is None else (
                "--delay-ms-ba", str(back.rtt_ms / 2), "--rate-mbit-ba", str(back.rate_mbit),
                "--loss-pct-ba", str(back.loss_pct),
            )  # fmt: skip
            self._link(j, link.src, link.dst, link.rtt_ms, link.rate_mbit, link.loss_pct, extra)

    def _name(self, names: list[str], name: str) -> None:
        """Add `name` to `names` (and tell the caller) before creating it: a kill while `ip` creates it still
        leaves its name to `prfaas down` (which deletes a name never created without complaint). The names carry
        our pid, so one that exists already is a dead run's leftover."""
        names.append(name)
        self._changed()

    def _free_subnet(self) -> None:
        """A control subnet 10.79.S.0/24 no other interface here holds (another mesh running, or one a crashed
        run left): two bridges on one subnet route one mesh's control traffic to the other's instances."""
        for step in range(250):
            subnet = (self.subnet - 1 + step) % 250 + 1
            if not ip("-4", "-o", "addr", "show", "to", f"10.79.{subnet}.0/24").stdout.strip():
                self.subnet, self.registry_host = subnet, f"10.79.{subnet}.1"
                return
        raise OSError("every control subnet 10.79.1-250.0/24 is in use: remove stale meshes (prfaas down)")

    def _instance(self, region: str, k: int, bridge: str) -> None:
        ns, site, n = self._ns(region, k), self._site(region), self._host[(region, k)]
        self._name(self.namespaces, ns)
        add_namespace(ns, WAN_SYSCTLS)
        host_end, ns_end = f"{self.tag}h{n}"[-15:], f"{self.tag}n{n}"[-15:]  # control: the root bridge
        self._name(self.devices, host_end)  # deleting it removes the pair, wherever its peer went
        ip("link", "add", host_end, "type", "veth", "peer", "name", ns_end)
        ip("link", "set", host_end, "master", bridge, "up")
        ip("link", "set", ns_end, "netns", ns)
        ip("-n", ns, "link", "set", ns_end, "name", "cp0")
        ip("-n", ns, "addr", "add", f"10.79.{self.subnet}.{n}/24", "dev", "cp0")
        ip("-n", ns, "link", "set", "cp0", "up")
        ip("-n", site, "link", "add", f"p{k}", "type", "veth", "peer", "name", f"i{k}")  # KV: the site's LAN
        ip("-n", site, "link", "set", f"p{k}", "master", "br0", "up")
        ip("-n", site, "link", "set", f"i{k}", "netns", ns)
        ip("-n", ns, "link", "set", f"i{k}", "name", "kv0")
        ip("-n", ns, "addr", "add", f"{self._lan(region)}.{k + 2}/24", "dev", "kv0")
        ip("-n", ns, "link", "set", "kv0", "up")
        ip("-n", ns, "route", "add", "default", "via", f"{self._lan(region)}.1")

    def link_emulator(self, src: str, dst: str) -> int | None:
        """The pid of the emulator of link `src -> dst` (SIGRTMIN cuts it, SIGRTMIN + 1 restores
        it: devstack/linkemu); None if the topology has no such link."""
        for j, link in enumerate(self.topology.links, start=1):
            if {link.src, link.dst} == {src, dst}:  # the pair's first link: its emulator carries both directions
                return self.groups.get(f"linkemu-{j}")
        return None

    def _link(self, j: int, src: str, dst: str, rtt_ms: float, rate_mbit: float, loss: float,
              extra: tuple[str, ...] = ()) -> None:  # fmt: skip
        """Emulator `j` between `src` (its a side) and `dst`; `extra`: the dst -> src direction's own figures."""
        tun_a, tun_b = f"{self.tag}t{j}a"[-15:], f"{self.tag}t{j}b"[-15:]
        argv = linkemu_argv(tun_a, tun_b, rtt_ms=rtt_ms, rate_mbit=rate_mbit, loss_pct=loss, seed=j, nice=-10,
                            extra=extra)  # fmt: skip

        def spawned(pid: int) -> None:  # named before it is ready: a kill while it starts leaves it to `down`
            self.groups[f"linkemu-{j}"] = pid
            self._changed()

        try:
            start_linkemu(argv, log=self.run_dir / f"linkemu-{j}.log", on_spawn=spawned)
        except OSError as exc:
            raise OSError(f"link {src} -> {dst}: {exc}") from None
        ends = ((src, tun_a, f"10.77.{j}.1", dst, f"10.77.{j}.2"), (dst, tun_b, f"10.77.{j}.2", src, f"10.77.{j}.1"))
        for region, tun, addr, peer, peer_addr in ends:
            site = self._site(region)
            attach_tun(tun, site, f"wan{j}", f"{addr}/30")
            ip("-n", site, "route", "add", f"{self._lan(peer)}.0/24", "via", peer_addr)

    def instance_listen(self, region: str, k: int) -> tuple[str, str]:
        return f"10.79.{self.subnet}.{self._host[(region, k)]}:0", f"{self._lan(region)}.{k + 2}:0"

    def argv_prefix(self, region: str, k: int) -> list[str]:
        return ["ip", "netns", "exec", self._ns(region, k)]
