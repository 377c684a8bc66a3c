"""The address a region instance tells others to dial it at (`advertise`).

A region listens where its config says, often on every interface (`0.0.0.0`), which is not
an address anyone can dial. It registers `advertise` when the config sets one; otherwise the
host it listens on when that is a real address; otherwise the address of this host's route
toward the registry (a connected UDP socket: the kernel picks the source address, nothing
is sent); otherwise loopback (a one-host deployment without a registry)."""

from __future__ import annotations

import ipaddress
import socket
from typing import Literal

from prfaas.region.config import RegionConfig
from prfaas.transport.endpoints import parse_hostport

WILDCARDS = frozenset({"0.0.0.0", "::", ""})


def advertised_host(config: RegionConfig, service: Literal["grpc", "kv"] = "grpc") -> str:
    """Where others dial `service` (the gRPC services, or the KV port) of this instance."""
    if config.advertise:
        return config.advertise
    host, _port = parse_hostport(config.listen.grpc if service == "grpc" else config.listen.kv)
    if host not in WILDCARDS:
        return host
    if config.control_plane_url:
        registry_host, registry_port = parse_hostport(config.control_plane_url)
        found = route_source(registry_host, registry_port)
        if found is not None:
            return found
    return "127.0.0.1"


def route_source(host: str, port: int) -> str | None:
    """The local address packets to (host, port) would leave from; None if no route."""
    try:
        family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    except ValueError:
        family = socket.AF_INET  # a name: resolved by connect
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((host, port or 9))
            return str(probe.getsockname()[0])
    except OSError:
        return None
