"""The prefill side of KV shipment over prfaas's own transports (the HF backend's; a vLLM
server's connector has its own): one pooled channel per decode region (shared by every job
to it), and waiting for a transfer under a job's deadline."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from prfaas.prefill_region import metrics
from prfaas.prefill_region.destination import Destination
from prfaas.protos.prfaas.v1 import registry_pb2
from prfaas.region.channels import TlsFiles
from prfaas.region.errors import DeadlineExceeded, Exhausted, InvalidRequest, Unavailable
from prfaas.transport.api import Shape, Shipment, ShipmentSpec, Transfer, TransferStatus
from prfaas.transport.endpoints import Endpoint
from prfaas.transport.identity import server_name
from prfaas.transport.pathmeter import PathReport
from prfaas.transport.shm_sender import ShmChannel
from prfaas.transport.tcp_sender import TcpChannel
from prfaas.transport.tls import client_context

IDLE_CLOSE_S = 300.0  # a channel no shipment has used for this long is closed (its decode instance gone, a typo)
MAX_CHANNELS = 64  # open channels at most: past it the least recently used idle one is closed for the new one

Channel = TcpChannel | ShmChannel


def ship_spec(
    job_id: str, attempt: int, dest: Destination, dtype: str, shapes: tuple[Shape, ...], timeout_s: float,
    trace: str = "", key_weights: Any = None,
) -> ShipmentSpec:  # fmt: skip
    """`key_weights`: the engine's query energy [num_layers, num_kv_heads, head_dim] (None: not calibrated)."""
    if timeout_s <= 0:
        raise DeadlineExceeded("no time left for the KV transfer")
    return ShipmentSpec(job_id, attempt, dest.ticket, dtype, shapes, codec=dest.codec, timeout_s=timeout_s,
                        traceparent=trace, key_weights=key_weights)  # fmt: skip


def wait_transfer(transfer: Transfer, deadline: float, stop: threading.Event) -> TransferStatus:
    """Wait for `transfer` until it ends, `deadline` passes (TIMEOUT) or `stop` is set (canceled)."""
    while not stop.is_set():
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        if transfer.wait(min(remaining, 0.1)).terminal:
            break
    status = transfer.status()
    if not status.terminal:
        transfer.cancel()
        status = transfer.status()
    return status


def shipment_ended(transfer: Transfer, *, kind: str) -> None:
    """Record `transfer`'s outcome in the region's metrics, once, where its shipment ends (however it ends:
    completed, canceled mid-forward, refused, an error): it is canceled first if still live. Bytes went on the
    wire either way."""
    if not transfer.status().terminal:
        transfer.cancel()
    status, stats = transfer.status(), transfer.stats
    metrics.SHIPMENTS.labels(kind, status.value).inc()
    metrics.SHIPPED_WIRE.inc(stats.wire_bytes)
    metrics.TRANSFER_SECONDS.observe(stats.seconds)
    if status is TransferStatus.COMPLETED:
        metrics.SHIPPED_RAW.inc(stats.raw_bytes)


def link_report(region: str, report: PathReport) -> registry_pb2.LinkReport:
    """A channel's path figures as the heartbeat carries them (ms; 0 = no RTT sample)."""
    return registry_pb2.LinkReport(
        peer_region=region, seconds=report.seconds, bytes_acked=report.bytes_acked,
        backlogged_s=report.backlogged_s, backlogged_bytes=report.backlogged_bytes,
        srtt_ms=1e3 * (report.srtt_s or 0.0), min_rtt_ms=1e3 * (report.min_rtt_s or 0.0),
        retransmits=report.retransmits,
    )  # fmt: skip


class ChannelPool:
    """One channel per decode region KV endpoint, created on first use: TCP (mutual TLS with `tls`: the
    receiver must present its region's server name), same-host shared memory, or WebRTC (signalled through
    `control_plane`). A channel with no transfer in flight that no shipment used for IDLE_CLOSE_S is closed
    (each holds a reaper, an encoder pool and a thread per stream that redials for good), and at most
    MAX_CHANNELS are open: a destination past them is RESOURCE_EXHAUSTED while every one is busy. A channel
    is busy while a transfer is in flight on it, or while it is checked out (`checkout`: handed to a job that
    has not submitted to it yet)."""

    def __init__(
        self,
        node: str,
        *,
        control_plane: str | None = None,
        ice_servers: tuple[Any, ...] = (),
        tls: TlsFiles | None = None,
    ) -> None:
        self.node = node
        self.control_plane = control_plane  # registry target, for WebRTC signalling
        self.ice_servers = ice_servers  # transport.webrtc.IceServer, from the region config
        self.tls = tls
        self._ssl = client_context(tls.node_cert()) if tls is not None else None
        self._lock = threading.Lock()
        self._channels: dict[tuple[Endpoint, str], Channel] = {}
        self._used: dict[tuple[Endpoint, str], float] = {}  # time.monotonic() of each channel's last check-out
        self._out: dict[tuple[Endpoint, str], int] = {}  # check-outs not yet returned, by channel
        self._closed = False  # `close` ran: a channel opened after it would never be closed

    @contextmanager
    def checkout(self, destination: Destination) -> Iterator[Channel]:
        """The channel to the destination's endpoint, kept open until the block ends: submit to it inside (the
        transfer keeps it open from then on). A TCP one opened here starts at the destination's stream count
        (the scheduler's plan), and its controller moves from there as it measures."""
        key = (destination.address, destination.decode_region)
        now = time.monotonic()
        doomed: list[Channel] = []
        try:
            with self._lock:
                if self._closed:
                    raise Unavailable("prefill region shutting down: its KV channels are closed")
                doomed += self._idle(now)
                channel = self._channels.get(key)
                if channel is None or channel.closed.is_set():
                    if len(self._channels) >= MAX_CHANNELS:
                        doomed.append(self._make_room())
                    channel = self._channels[key] = self._open(
                        destination.address, destination.decode_region, destination.num_streams or None
                    )
                self._used[key] = now
                self._out[key] = self._out.get(key, 0) + 1
        finally:
            _close_later(doomed)
        try:
            yield channel
        finally:
            with self._lock:
                self._out[key] -= 1
                if not self._out[key]:
                    del self._out[key]

    @contextmanager
    def ship(self, destination: Destination, shipment: Shipment, *, kind: str) -> Iterator[Transfer]:
        """`shipment` submitted to the destination's channel; when the block ends its transfer is canceled if
        still live, and its outcome recorded (`shipment_ended`: once, however the job ended)."""
        with self.checkout(destination) as channel:
            transfer = channel.submit(shipment)
        try:
            yield transfer
        finally:
            shipment_ended(transfer, kind=kind)

    def _busy(self, key: tuple[Endpoint, str], channel: Channel) -> bool:
        return key in self._out or bool(channel.table.live())

    def _idle(self, now: float) -> list[Channel]:
        """Take out (under the lock) the channels closed, or idle for IDLE_CLOSE_S and not busy."""
        gone = [k for k, ch in self._channels.items()
                if ch.closed.is_set() or (now - self._used[k] > IDLE_CLOSE_S and not self._busy(k, ch))]  # fmt: skip
        for key in gone:
            self._used.pop(key)
        return [self._channels.pop(key) for key in gone]

    def _make_room(self) -> Channel:
        idle = [k for k, ch in self._channels.items() if not self._busy(k, ch)]
        if not idle:
            raise Exhausted(f"{len(self._channels)} KV channels are open and busy; the destination must wait")
        oldest = min(idle, key=self._used.__getitem__)
        self._used.pop(oldest)
        return self._channels.pop(oldest)

    def _open(self, endpoint: Endpoint, region: str, streams: int | None = None) -> Channel:
        if endpoint.kind == "shm":
            return ShmChannel(endpoint.path, node=self.node)
        if endpoint.kind == "webrtc":
            from prfaas.region.signal_client import signaller
            from prfaas.transport.webrtc_sender import WebRtcChannel

            if self.control_plane is None:
                raise InvalidRequest(f"{endpoint} needs a control plane to signal through (control_plane_url)")
            signal = signaller(self.control_plane, endpoint.region, self.tls)
            return WebRtcChannel(signal, peer=endpoint.region, node=self.node, ice_servers=self.ice_servers)
        if self._ssl is None:
            return TcpChannel((endpoint.host, endpoint.port), node=self.node, initial_streams=streams)
        if not region:
            raise InvalidRequest("destination.decode_region is required with mutual TLS: the KV port's server name")
        return TcpChannel((endpoint.host, endpoint.port), node=self.node, ssl_context=self._ssl,
                          server_hostname=server_name(region), initial_streams=streams)  # fmt: skip

    def path_reports(self) -> list[tuple[str, PathReport]]:
        """Each TCP channel's path figures since the last call, by decode region (a region with
        several instances: one report per instance's channel). Idle channels are closed here too
        (a heartbeat calls it)."""
        with self._lock:
            _close_later(self._idle(time.monotonic()))
            channels = [(region, ch) for (_, region), ch in self._channels.items() if isinstance(ch, TcpChannel)]
        return [(region, report) for region, ch in channels if region and (report := ch.meter.take()) is not None]

    def num_open(self) -> int:
        with self._lock:
            return len(self._channels)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            channels, self._channels, self._used = list(self._channels.values()), {}, {}
        for channel in channels:
            channel.close()


def _close_later(channels: list[Channel]) -> None:
    """Close `channels` on a thread of their own: a close waits up to 5 s for its streams."""
    for channel in channels:
        threading.Thread(target=channel.close, name="prfaas-channel-close", daemon=True).start()
