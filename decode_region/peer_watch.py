"""Watch a prefill region while it owes us KV: if it dies (its gRPC health stream breaks),
the reservations waiting on it are failed with UNAVAILABLE and their buffers freed.

A killed process closes its sockets, so the health stream breaks at once; a vanished host
(partition, power loss) is caught by the channel's keepalive within about two heartbeat
intervals (`keepalive_options`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from prfaas.protos.rpc import keepalive_options

log = logging.getLogger(__name__)
PREFILL_SERVICE = "prfaas.v1.PrefillRegion"


class Watch:
    """One watch; `stop()` ends it without calling `on_lost`."""

    def __init__(self, call: grpc.RpcContext | None) -> None:
        self._call = call
        self.stopped = threading.Event()

    def stop(self) -> None:
        self.stopped.set()
        if self._call is not None:
            self._call.cancel()


class PeerWatcher:
    def __init__(self, heartbeat_interval_s: float) -> None:
        self._options = keepalive_options(heartbeat_interval_s)
        self._lock = threading.Lock()
        self._channels: dict[str, grpc.Channel] = {}

    def _channel(self, target: str) -> grpc.Channel:
        with self._lock:
            channel = self._channels.get(target)
            if channel is None:
                channel = self._channels[target] = grpc.insecure_channel(target, options=self._options)
            return channel

    def watch(self, target: str, timeout_s: float, on_lost: Callable[[str], None]) -> Watch:
        """Call `on_lost(reason)` once if `target` stops answering within `timeout_s`, unless
        the watch was stopped first."""
        stub = health_pb2_grpc.HealthStub(self._channel(target))
        call = stub.Watch(health_pb2.HealthCheckRequest(service=PREFILL_SERVICE), timeout=timeout_s)
        watch = Watch(call)

        def run() -> None:
            try:
                for _reply in call:
                    pass  # NOT_SERVING (draining) still finishes its jobs: only a broken stream counts
                reason = "health stream ended"
            except grpc.RpcError as exc:
                if exc.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED):
                    return  # stopped by us, or the reservation's own deadline handles it
                reason = f"{exc.code().name}: {exc.details()}"
            if not watch.stopped.is_set():
                log.warning("prefill region %s lost: %s", target, reason)
                on_lost(f"prefill region {target} is unavailable ({reason})")

        threading.Thread(target=run, name="prfaas-peer-watch", daemon=True).start()
        return watch

    def close(self) -> None:
        with self._lock:
            channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            channel.close()
