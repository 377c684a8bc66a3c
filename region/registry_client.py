"""Region -> control plane: `Register` once (again when the registry asks), then a
`Heartbeat` with the region's load every interval. A registry that is down costs a log
line per interval, never a stalled region; every call has a deadline of one interval."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable

import grpc

from prfaas.protos.prfaas.v1 import registry_pb2, registry_pb2_grpc
from prfaas.region.channels import TlsFiles, channel, keepalive_options
from prfaas.transport.identity import server_name

log = logging.getLogger(__name__)
MIN_CALL_TIMEOUT_S = 2.0
# a Register refused for what it says (a price, an interval) or who says it (a certificate): the region's
# configuration, not an outage, so every refusal is an error in the log, not one in a minute
REFUSED = frozenset({grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.PERMISSION_DENIED})


class Heartbeater:
    def __init__(
        self,
        target: str,
        registration: registry_pb2.RegisterRequest,
        load: Callable[[], registry_pb2.Load],
        interval_s: float = 1.0,
        tls: TlsFiles | None = None,
    ) -> None:
        """`tls`: this instance's certificate; the registry must present the control plane's."""
        self.target = target
        self.registration = registration
        self.interval_s = interval_s
        # a call may take longer than a beat's interval (a new connection's TCP and TLS handshakes across a WAN,
        # a loaded host); the registry forgets an instance only after several silent intervals
        self.call_timeout_s = max(interval_s, MIN_CALL_TIMEOUT_S)
        self._load = load
        self._channel = channel(target, tls, server_name(None), control_plane_options(interval_s))
        self._stub = registry_pb2_grpc.RegistryStub(self._channel)
        self.region_id = ""
        self.seq = 0
        self.registrations = 0  # Register calls answered: the registry may know nothing the beats before said
        self._beating = threading.Lock()  # one beat at a time: the loop's, or stop's last one
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="prfaas-heartbeat", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def beat(self) -> None:
        """One round: register if needed, then heartbeat. Raises grpc.RpcError."""
        with self._beating:
            self._beat()

    def _beat(self) -> None:
        if not self.region_id:
            reply = self._stub.Register(self.registration, timeout=self.call_timeout_s)
            self.region_id = reply.region_id or self.registration.name
            self.registrations += 1
            log.info("registered with %s as %s", self.target, self.region_id)
        self.seq += 1
        request = registry_pb2.HeartbeatRequest(
            name=self.registration.name, region_id=self.region_id, seq=self.seq, load=self._load(),
            instance=self.registration.instance,
        )  # fmt: skip
        if self._stub.Heartbeat(request, timeout=self.call_timeout_s).reregister:
            self.region_id = ""

    def _loop(self) -> None:
        failures = 0
        while True:
            try:
                self.beat()
                failures = 0
            except grpc.RpcError as exc:
                failures += 1
                if not self.region_id and exc.code() in REFUSED:
                    log.error("the registry at %s refuses to register this instance (%d in a row): %s: %s",
                              self.target, failures, exc.code().name, exc.details())  # fmt: skip
                elif failures in (1, 10) or failures % 60 == 0:
                    log.warning("heartbeat to %s failed (%d in a row): %s", self.target, failures, exc.code().name)
            except Exception:  # a figure the message cannot carry, say: the next beat tries again, the thread lives
                failures += 1
                if failures in (1, 10) or failures % 60 == 0:
                    log.exception("heartbeat to %s could not be made (%d in a row)", self.target, failures)
            if self._stop.wait(self.interval_s):
                return

    def stop(self) -> None:
        """Stop after one last heartbeat, if registered (a stopping region says `draining` in it:
        region/server.py), sent after any beat still in flight."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(2 * self.interval_s)
        if self._beating.acquire(timeout=self.call_timeout_s):
            try:
                if self.region_id:  # a region that never registered does not register as it stops
                    with contextlib.suppress(grpc.RpcError):
                        self._beat()
            finally:
                self._beating.release()
        self._channel.close()


def control_plane_options(interval_s: float) -> list[tuple[str, int]]:
    """A region's channel to the control plane (heartbeats, WebRTC offers): `keepalive_options`, and
    a reconnect backoff of a few intervals at most: gRPC's grows to 120 s, so a restarted control
    plane would wait that long for its regions."""
    backoff_ms = max(1000, int(interval_s * 3000))
    return [
        *keepalive_options(interval_s),  # sets min_reconnect_backoff_ms (the connect timeout): not again here
        ("grpc.initial_reconnect_backoff_ms", min(backoff_ms, 500)),
        ("grpc.max_reconnect_backoff_ms", backoff_ms),
    ]
