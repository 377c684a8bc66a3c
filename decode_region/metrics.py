"""Prometheus metrics of a decode region (the process's default registry, served on /metrics)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

KV_USED = Gauge("prfaas_decode_kv_used_bytes", "KV buffer bytes held by reservations")
KV_FREE = Gauge("prfaas_decode_kv_free_bytes", "KV buffer bytes free")
RESERVATIONS = Gauge("prfaas_decode_reservations", "reservations held now")
RESERVATIONS_ENDED = Counter("prfaas_decode_reservations_ended_total", "reservations ended, by outcome", ["outcome"])
KV_RECEIVED = Counter("prfaas_decode_kv_received_bytes_total", "raw KV bytes of shipments received and assembled")
SHIPMENT_SECONDS = Counter("prfaas_decode_kv_wait_seconds_total", "seconds from Reserve to a complete KV")
BUSY_WORKERS = Gauge("prfaas_decode_busy_workers", "engine workers decoding or generating now")
TOKENS = Counter("prfaas_decode_tokens_total", "tokens streamed, by path", ["path"])
TOKENS_PER_S = Gauge("prfaas_decode_tokens_per_second", "recent decode throughput (tokens/s)")
PREFILL_TOKENS_PER_S = Gauge(
    "prfaas_decode_local_prefill_tokens_per_second", "recent prefill throughput of local (Generate) requests (tokens/s)"
)


class Smoothed:
    """A recent rate, mirrored to `gauge`: the first sample, then 0.8 of the value and 0.2 of each new sample."""

    def __init__(self, gauge: Gauge) -> None:
        self.gauge = gauge
        self.value = 0.0

    def add(self, sample: float) -> None:
        self.value = sample if self.value == 0 else 0.8 * self.value + 0.2 * sample
        self.gauge.set(self.value)
