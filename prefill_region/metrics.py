"""Prometheus metrics of a prefill region (the process's default registry, served on /metrics).
The transport adds its own per-peer series (prfaas_kv_*)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

QUEUE_DEPTH = Gauge("prfaas_prefill_queue_depth", "prefill jobs admitted and waiting for a worker")
BUSY_WORKERS = Gauge("prfaas_prefill_busy_workers", "engine workers running a prefill now")
JOBS = Counter("prfaas_prefill_jobs_total", "prefill jobs ended, by outcome", ["outcome"])
REJECTED = Counter("prfaas_prefill_rejected_total", "prefill jobs refused at admission, by reason", ["reason"])
TOKENS = Counter("prfaas_prefill_tokens_total", "prompt tokens prefilled")
TOKENS_PER_S = Gauge("prfaas_prefill_tokens_per_second", "recent prefill throughput (tokens/s)")
SHIPMENTS = Counter("prfaas_region_shipments_total", "KV shipments ended, by kind and status", ["kind", "status"])
SHIPPED_RAW = Counter("prfaas_region_shipped_raw_bytes_total", "raw KV bytes of completed shipments")
SHIPPED_WIRE = Counter("prfaas_region_shipped_wire_bytes_total", "KV bytes on the wire of ended shipments")
TRANSFER_SECONDS = Histogram(
    "prfaas_region_transfer_seconds",
    "seconds from submit to the end of a shipment",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
LEASES = Gauge("prfaas_prefill_kv_leases", "finished KV caches kept for re-shipment")
