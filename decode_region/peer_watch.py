"""Watch a prefill region while it owes us KV: if it dies (its gRPC health stream breaks),
the reservations waiting on it are failed with `PrefillLost` (ABORTED) and their buffers freed.

One health `Watch` stream per prefill region, shared by every reservation that waits on it
(not one per reservation): opening and cancelling a stream per job made the prefill region's
health servicer churn, and is where grpcio-health-checking's non-blocking servicer can
deadlock the whole gRPC server (see region/server.py). A stream lives `STREAM_S` at
most and is reopened while reservations still wait on it, so no wait is unbounded. A region
whose Watch streams are all taken (RESOURCE_EXHAUSTED, region/health.py) answered: it is alive,
and is watched again a second later.

A killed process closes its sockets, so the health stream breaks at once; a vanished host
(partition, power loss) is caught by the channel's keepalive within a heartbeat interval
and max(2 s, an interval) (`keepalive_options`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from prfaas.region.channels import TlsFiles, keepalive_options, replies
from prfaas.region.channels import channel as open_channel
from prfaas.region.errors import RegionError, Unavailable
from prfaas.transport.identity import server_name

log = logging.getLogger(__name__)
PREFILL_SERVICE = "prfaas.v1.PrefillRegion"
STREAM_S = 60.0  # one Watch call's deadline; reopened if reservations still wait on the region
# (it also bounds a stream whose connection gRPC never notices closing: seen about once in 500
# stops of a region while the call connects, the client's socket left in CLOSE-WAIT)
BUSY_RETRY_S = 1.0  # after a region refused the Watch (RESOURCE_EXHAUSTED: its streams are all taken)


class PrefillLost(RegionError, code=grpc.StatusCode.ABORTED):
    """The prefill region that owed a reservation its KV stopped answering: the KV will not come, and this
    decode region is not to blame. Not UNAVAILABLE (what a decode region itself down or draining answers,
    and what the control plane suspects the decode instance on): ABORTED, which no other outcome here has
    and gRPC itself never makes, so the control plane leaves the prefill instance out instead and computes
    the prompt again (control_plane/jobs/decode_calls.py `PREFILL_LOST`)."""


class Watch:
    """One reservation's interest in a region; `stop()` ends it without calling `on_lost`."""

    def __init__(self, stream: _Stream, on_lost: Callable[[str], object]) -> None:
        self._stream = stream
        self.on_lost = on_lost
        self.stopped = threading.Event()

    def stop(self) -> None:
        self.stopped.set()
        self._stream.leave(self)


class _Stream:
    """The health stream to one region and the watches that share it."""

    def __init__(self, target: str, stub: health_pb2_grpc.HealthStub, lock: threading.Lock) -> None:
        self.target = target
        self.stub = stub
        self.lock = lock  # the PeerWatcher's
        self.watches: set[Watch] = set()
        self.call: Any = None  # the Watch call (a grpc.Call and grpc.Future)
        self.ended = False  # broken or closed: a new watch opens a new stream
        self.closed = False
        self.answered = threading.Event()  # the region has sent its status on this stream
        self.wake = threading.Event()  # set by close: a wait before the next call ends

    def leave(self, watch: Watch) -> None:
        with self.lock:
            self.watches.discard(watch)

    def run(self, forget: Callable[[_Stream], None]) -> None:
        reason = ""
        while True:
            with self.lock:
                if self.closed:
                    return
                call = self.call = self.stub.Watch(
                    health_pb2.HealthCheckRequest(service=PREFILL_SERVICE), timeout=STREAM_S
                )
            try:
                for _reply in replies(call):  # not `for _ in call`: that can hang on an ended call
                    self.answered.set()  # NOT_SERVING (draining) still finishes its jobs: only a broken stream counts
                reason = "health stream ended"
            except grpc.RpcError as exc:
                # RESOURCE_EXHAUSTED: the region answered (alive), its Watch streams are all taken
                # (region/health.py): watch again shortly, the reservations' own deadlines bound the wait
                busy = exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED or busy:
                    if busy:
                        self.wake.wait(BUSY_RETRY_S)
                    with self.lock:
                        if self.watches and not self.closed:
                            continue  # still owed KV: keep watching on a fresh call
                        self.ended = True
                    forget(self)
                    return
                if exc.code() == grpc.StatusCode.CANCELLED and self.closed:
                    return
                reason = f"{exc.code().name}: {exc.details()}"
            break
        with self.lock:
            self.ended = True
            lost, self.watches = list(self.watches), set()
        forget(self)
        if lost:
            log.warning("prefill region %s lost: %s (%d reservations waiting)", self.target, reason, len(lost))
        for watch in lost:
            if not watch.stopped.is_set():
                watch.on_lost(f"prefill region {self.target} is unavailable ({reason})")

    def close(self) -> None:
        self.wake.set()
        with self.lock:
            self.closed = True
            call = self.call
        if call is not None:
            call.cancel()


class PeerWatcher:
    """`tls`: this region's material; a watched region must then present its own server name."""

    def __init__(self, heartbeat_interval_s: float, tls: TlsFiles | None = None) -> None:
        self._options = keepalive_options(heartbeat_interval_s)
        self._tls = tls
        self._lock = threading.Lock()
        self._channels: dict[str, grpc.Channel] = {}  # the open streams' (one per watched region)
        self._streams: dict[str, _Stream] = {}
        self._closed = False

    def watch(self, target: str, on_lost: Callable[[str], object], region: str = "") -> Watch:
        """Call `on_lost(reason)` once if `target` (an instance of prefill region `region`)
        stops answering, unless the watch was stopped first. The caller's own deadline bounds
        how long it waits for the KV."""
        with self._lock:
            if self._closed:  # else its stream and channel would outlive the watcher
                raise Unavailable("decode region shutting down")
            stream = self._streams.get(target)
            start = stream is None or stream.ended
            if start:
                channel = self._channels.get(target)
                if channel is None:
                    name = server_name(region) if region else target.rsplit(":", 1)[0]
                    channel = self._channels[target] = open_channel(target, self._tls, name, self._options)
                stream = self._streams[target] = _Stream(target, health_pb2_grpc.HealthStub(channel), self._lock)
            assert stream is not None
            watch = Watch(stream, on_lost)
            stream.watches.add(watch)
        if start:
            threading.Thread(target=stream.run, args=(self._forget,), name="prfaas-peer-watch", daemon=True).start()
        return watch

    def _forget(self, stream: _Stream) -> None:
        """`stream` ended: its channel is closed with it (nothing else uses it; a later watch opens
        another), unless a newer stream to the region has taken the channel over."""
        with self._lock:
            if self._streams.get(stream.target) is not stream:
                return
            del self._streams[stream.target]
            channel = self._channels.pop(stream.target, None)
        if channel is not None:
            channel.close()

    def answered(self, target: str) -> bool:
        """Whether the open stream to `target` has had the region's status."""
        with self._lock:
            stream = self._streams.get(target)
        return stream is not None and stream.answered.is_set()

    @property
    def streams(self) -> int:
        """Open health streams (one per prefill region watched)."""
        with self._lock:
            return len(self._streams)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            streams, self._streams = list(self._streams.values()), {}
            channels, self._channels = list(self._channels.values()), {}
        for stream in streams:
            stream.close()
        for channel in channels:
            channel.close()
