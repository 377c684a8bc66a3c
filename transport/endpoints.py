"""KV endpoints: how a decode region says where senders reach it, and which one a sender
uses. A region's `kv_endpoint` lists alternatives separated by commas:

    10.0.0.5:7400                          TCP (the default; any host)
    [2001:db8::5]:7400                     TCP to an IPv6 address: brackets required
    shm://<host id>/tmp/prfaas-kv-d.sock   shared memory (transport/shm_receiver.py): same host only
    webrtc://<region name>                 WebRTC data channels, signalled through the control plane

`choose` takes the fastest one this process can use: shared memory when the receiver is on
this host *and* in this network and mount namespace (`host_id`: regions in different
namespaces emulate different hosts, so their WAN emulation is never bypassed), else TCP,
else WebRTC.
"""

from __future__ import annotations

import functools
import ipaddress
import os
from dataclasses import dataclass
from typing import Literal

Kind = Literal["tcp", "shm", "webrtc"]


@dataclass(frozen=True)
class Endpoint:
    kind: Kind
    host: str = ""  # tcp
    port: int = 0  # tcp
    path: str = ""  # shm: the receiver's Unix control socket
    host_id: str = ""  # shm: `host_id()` of the receiver
    region: str = ""  # webrtc: the receiving region's name, for signalling

    def __str__(self) -> str:
        if self.kind == "shm":
            return f"shm://{self.host_id}{self.path}"
        if self.kind == "webrtc":
            return f"webrtc://{self.region}"
        return hostport(self.host, self.port)


def hostport(host: str, port: int) -> str:
    """`host:port`, brackets around an IPv6 address: what `parse_hostport` and `parse_endpoint` read back."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _split_hostport(text: str, min_port: int, expected: str) -> tuple[str, int]:
    """(host, port) of `host:port` or `[v6 address]:port`, port in min_port..65535; ValueError saying
    `text` is not `expected`. An address with colons must be bracketed: `2001:db8::5:7400` could mean
    port 7400 or no port at all, so it is refused rather than guessed at."""
    if text.startswith("["):
        host, closed, port = text[1:].partition("]")
        if not closed or not port.startswith(":"):  # "[::1", "[host:7400", "[::1]7400"
            raise ValueError(f"{text!r} is not {expected}: a bracketed address is [addr]:port")
        port = port[1:]
    else:
        host, sep, port = text.rpartition(":")
        if not sep:
            raise ValueError(f"{text!r} is not {expected}")
        if ":" in host:
            raise ValueError(f"{text!r} is not {expected}: an IPv6 address needs [addr]:port")
    if not host or "[" in host or "]" in host:
        raise ValueError(f"{text!r} is not {expected}: no host, or a stray bracket")
    # ASCII only: str.isdigit() takes other scripts' digits, which int() then reads
    if not (port.isascii() and port.isdigit() and len(port) <= 5 and min_port <= int(port) <= 65535):
        raise ValueError(f"{text!r} is not {expected}: the port is not a number in {min_port}-65535")
    return host, int(port)


def parse_hostport(value: str) -> tuple[str, int]:
    """A listen or dial address `host:port` (`[v6]:port`); port 0 picks a free one. ValueError otherwise."""
    return _split_hostport(value, 0, "host:port or [v6 addr]:port (port 0-65535; 0 picks a free one)")


def is_loopback(hostport: str) -> bool:
    """`host:port` on this host only (localhost, 127.0.0.0/8, ::1): what may be served without TLS."""
    host, _port = parse_hostport(hostport)
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def parse_endpoint(text: str) -> Endpoint:
    """One endpoint; ValueError naming what is wrong."""
    text = text.strip()
    if text.startswith("shm://"):
        host_id, slash, path = text.removeprefix("shm://").partition("/")
        if not host_id or not slash:
            raise ValueError(f"{text!r} is not shm://<host id>/<socket path>")
        return Endpoint("shm", path="/" + path, host_id=host_id)
    if text.startswith("webrtc://"):
        region = text.removeprefix("webrtc://")
        if not region or "/" in region:
            raise ValueError(f"{text!r} is not webrtc://<region name>")
        return Endpoint("webrtc", region=region)
    host, port = _split_hostport(text, 1, "host:port, [v6 addr]:port, shm://<host id>/<path> or webrtc://<region>")
    return Endpoint("tcp", host=host, port=port)


def parse_endpoints(text: str) -> tuple[Endpoint, ...]:
    endpoints = tuple(parse_endpoint(part) for part in text.split(",") if part.strip())
    if not endpoints:
        raise ValueError("no KV endpoint given")
    return endpoints


@functools.cache
def host_id() -> str:
    """This host (boot id) and this process's network and mount namespaces: two processes
    with the same id can share memory through a Unix socket path and a memfd."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip().replace("-", "")[:16]
        net, mnt = os.stat("/proc/self/ns/net").st_ino, os.stat("/proc/self/ns/mnt").st_ino
    except OSError:
        return "unknown"  # not Linux: shared memory is never chosen
    return f"{boot}-{net}-{mnt}"


def choose(endpoints: tuple[Endpoint, ...], local_host_id: str | None = None) -> Endpoint:
    """The endpoint to ship on: shared memory if usable from here, else TCP, else WebRTC."""
    here = host_id() if local_host_id is None else local_host_id
    for endpoint in endpoints:
        if endpoint.kind == "shm" and endpoint.host_id == here != "unknown" and os.path.exists(endpoint.path):
            return endpoint
    for kind in ("tcp", "webrtc"):
        for endpoint in endpoints:
            if endpoint.kind == kind:
                return endpoint
    raise ValueError(f"none of {', '.join(map(str, endpoints))} can be reached from this host")
