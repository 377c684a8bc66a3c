"""A region's gRPC health service (grpc.health.v1) with its Watch streams bounded.

Each Watch holds a thread of the region's RPC pool while it is open (the servicer is the blocking
one: region/server.py says why). Decode regions legitimately hold one per prefill instance that
owes them KV, per process (decode_region/peer_watch.py: one stream shared by every reservation,
reopened each minute); with mutual TLS any region's certificate may watch (region/authz.py). So:
at most `max_watches` streams at once in all (the server's pool has that many threads more than its
own calls need: watches never take the control plane's), and with TLS at most
`max_per_caller` of one caller (its certificate's identity; with a certificate every instance of a
region shares, that and the caller's host), so one region cannot take every slot. Past either
limit a Watch ends RESOURCE_EXHAUSTED before it holds a thread, and the watcher, which has just heard
from a live region, watches again a little later.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Iterator
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2

from prfaas.region.authz import peer_identity

MAX_WATCHES = 64  # Watch streams open at once, all callers together (each one a thread of the pool)
MAX_WATCHES_PER_CALLER = 4  # one per watching process, and room for a stream its server has not yet seen end


class BoundedHealth:
    """The Health service (`add_HealthServicer_to_server` takes it): `servicer`'s Check as is, its
    Watch within the limits above (`per_caller` None: no limit per caller, for a server without
    TLS, whose callers have no identity and are all trusted). Statuses are set on `servicer`."""

    def __init__(
        self, servicer: health.HealthServicer, max_watches: int = MAX_WATCHES, per_caller: int | None = None
    ) -> None:
        self.servicer = servicer
        self.max_watches = max_watches
        self.per_caller = per_caller
        self._lock = threading.Lock()
        self._open: collections.Counter[str] = collections.Counter()  # caller -> its Watch streams open

    def Check(  # noqa: N802 (the name the .proto gives it)
        self, request: health_pb2.HealthCheckRequest, context: grpc.ServicerContext
    ) -> health_pb2.HealthCheckResponse:
        return self.servicer.Check(request, context)

    def List(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        return self.servicer.List(request, context)

    def Watch(  # noqa: N802
        self, request: health_pb2.HealthCheckRequest, context: grpc.ServicerContext
    ) -> Iterator[health_pb2.HealthCheckResponse]:
        caller = _caller(context) if self.per_caller is not None else ""
        with self._lock:
            full = sum(self._open.values()) >= self.max_watches
            mine = self.per_caller is not None and self._open[caller] >= self.per_caller
            if not (full or mine):
                self._open[caller] += 1
        if full or mine:
            whose = f"{caller} has {self.per_caller}" if mine else f"{self.max_watches} are"
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"health Watch streams: {whose} open already")
        try:
            yield from self.servicer.Watch(request, context)  # the blocking servicer's replies
        finally:
            with self._lock:
                self._open[caller] -= 1
                if self._open[caller] <= 0:
                    del self._open[caller]

    @property
    def num_watches(self) -> int:
        with self._lock:
            return sum(self._open.values())


def _caller(context: grpc.ServicerContext) -> str:
    """Whose Watch this is: the certificate's identity; with one that every instance of a region
    shares (`*`), also the caller's host (context.peer(): "ipv4:10.0.0.5:51234")."""
    identity = peer_identity(context)
    host = context.peer().rsplit(":", 1)[0]
    if identity is None:
        return host
    return identity.uri if identity.instance != "*" else f"{identity.uri} at {host}"
