"""The prefill side of KV shipment: one pooled `TcpChannel` per decode region (shared by
every job to it), destination parsing, and waiting for a transfer under a job's deadline."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from prfaas.prefill_region import metrics
from prfaas.protos.prfaas.v1 import prefill_pb2
from prfaas.protos.region_config import parse_hostport
from prfaas.protos.rpc import DeadlineExceeded, InvalidRequest
from prfaas.transport.api import Shape, ShipmentSpec, Transfer, TransferStatus
from prfaas.transport.codecs import get_codec
from prfaas.transport.errors import CodecError
from prfaas.transport.tcp import TcpChannel


@dataclass(frozen=True)
class Destination:
    address: tuple[str, int]
    ticket: str
    codec: str

    @staticmethod
    def parse(msg: prefill_pb2.Destination, default_codec: str) -> Destination:
        try:
            address = parse_hostport(msg.kv_endpoint)
        except ValueError as exc:
            raise InvalidRequest(f"destination.kv_endpoint: {exc}") from None
        if not msg.ticket:
            raise InvalidRequest("destination.ticket is required (signed by the control plane)")
        codec = msg.codec or default_codec
        try:
            get_codec(codec)
        except (CodecError, ValueError, KeyError):
            raise InvalidRequest(f"destination.codec {codec!r} is not one of raw, lossless, fp8, int8") from None
        return Destination(address, msg.ticket, codec)


def ship_spec(
    job_id: str, attempt: int, dest: Destination, dtype: str, shapes: tuple[Shape, ...], timeout_s: float
) -> ShipmentSpec:
    if timeout_s <= 0:
        raise DeadlineExceeded("no time left for the KV transfer")
    return ShipmentSpec(job_id, attempt, dest.ticket, dtype, shapes, codec=dest.codec, timeout_s=timeout_s)


def wait_transfer(transfer: Transfer, deadline: float, stop: threading.Event, *, kind: str) -> TransferStatus:
    """Wait for `transfer` until it ends, `deadline` passes (TIMEOUT) or `stop` is set
    (canceled); record the outcome in the region's metrics."""
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
    stats = transfer.stats
    metrics.SHIPMENTS.labels(kind, status.value).inc()
    metrics.SHIPPED_WIRE.inc(stats.wire_bytes)
    metrics.TRANSFER_SECONDS.observe(stats.seconds)
    if status is TransferStatus.COMPLETED:
        metrics.SHIPPED_RAW.inc(stats.raw_bytes)
    return status


class ChannelPool:
    """One channel per decode region KV address, created on first use, closed together."""

    def __init__(self, node: str) -> None:
        self.node = node
        self._lock = threading.Lock()
        self._channels: dict[tuple[str, int], TcpChannel] = {}

    def get(self, address: tuple[str, int]) -> TcpChannel:
        with self._lock:
            channel = self._channels.get(address)
            if channel is None or channel.closed.is_set():
                channel = self._channels[address] = TcpChannel(address, node=self.node)
            return channel

    def close(self) -> None:
        with self._lock:
            channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            channel.close()
