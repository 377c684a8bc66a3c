"""Prometheus metrics of the KV transport (the process's default registry; region services
expose it on /metrics). Labelled by peer ("host:port"), a bounded set: a region's KV peers."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

STREAMS = Gauge("prfaas_kv_streams", "TCP streams a channel uses to the peer (adaptive or fixed)", ["peer"])
STREAMS_CONNECTED = Gauge("prfaas_kv_streams_connected", "TCP streams connected to the peer now", ["peer"])
QUEUEING_DELAY = Gauge(
    "prfaas_kv_queueing_delay_seconds", "median smoothed RTT minus minimum RTT of the streams, last window", ["peer"]
)
WIRE_BYTES = Counter("prfaas_kv_wire_bytes_total", "KV frame bytes sent, resends included", ["peer"])
RAW_BYTES = Counter("prfaas_kv_raw_bytes_total", "raw KV bytes of completed shipments", ["peer", "codec"])
RESENT_CHUNKS = Counter("prfaas_kv_resent_chunks_total", "chunks sent again (broken stream, bad checksum)", ["peer"])
RESENT_BYTES = Counter("prfaas_kv_resent_bytes_total", "KV frame bytes sent again (of wire bytes)", ["peer"])
STALLS = Counter("prfaas_kv_stalls_total", "connections reset after stall_timeout_s without an ACK", ["peer"])
TRANSFERS = Counter("prfaas_kv_transfers_total", "shipments ended, by status", ["peer", "status"])
