"""Prometheus series of metering: $ billed by phase and region, colocated $ and savings, ledger writes and
errors, the billing queue, wasted attempts, and every price at scrape time (`PriceCollector`)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from prfaas.control_plane.billing.models import UsageEntry
from prfaas.control_plane.billing.prices import PriceBook


class MeteringMetrics:
    """Prometheus series of metering. Labels are bounded: region (the fleet's regions), phase, placement,
    market, source; never a tenant or a job."""

    def __init__(self, registry: CollectorRegistry, prices: PriceBook | None = None) -> None:
        self.prices = PriceCollector(prices)
        r = registry
        self.billed_usd = Counter("prfaas_billed_usd", "$ billed to tenants", ["phase", "region"], registry=r)
        self.colocated_usd = Counter(
            "prfaas_colocated_usd", "$ the billed jobs would have cost colocated in their decode region", ["region"],
            registry=r,
        )  # fmt: skip
        self.savings_usd = Gauge(
            "prfaas_savings_usd", "colocated $ - billed $ of jobs billed by this process", ["region"], registry=r
        )
        self.billed_jobs = Counter("prfaas_billed_jobs", "ledger entries written", ["placement"], registry=r)
        self.billed_cut_jobs = Counter(
            "prfaas_billed_cut_jobs", "ledger entries of jobs their client canceled (billed up to the cut; also in "
            "prfaas_billed_jobs_total)", ["placement"], registry=r,
        )  # fmt: skip
        self.wasted_usd = Counter(
            "prfaas_wasted_usd", "platform cost of attempts that did not answer", ["phase", "region"], registry=r
        )
        self.write_s = Histogram("prfaas_ledger_write_seconds", "billing one job (read, price, write)", registry=r)
        self.errors = Counter("prfaas_ledger_errors", "billing attempts that raised", registry=r)
        self.queue_depth = Gauge("prfaas_ledger_queue_depth", "finished jobs waiting to be billed", registry=r)
        r.register(self.prices)

    def billed(self, entry: UsageEntry, *, cut: bool = False) -> None:
        self.billed_usd.labels("prefill", entry.prefill_region).inc(entry.prefill_usd)
        self.billed_usd.labels("decode", entry.decode_region).inc(entry.decode_usd)
        if entry.egress_usd:
            self.billed_usd.labels("egress", entry.prefill_region).inc(entry.egress_usd)
        self.colocated_usd.labels(entry.decode_region).inc(entry.colocated_usd)
        self.savings_usd.labels(entry.decode_region).inc(entry.savings_usd)
        self.billed_jobs.labels(entry.placement or "unknown").inc()
        if cut:
            self.billed_cut_jobs.labels(entry.placement or "unknown").inc()


class PriceCollector(Collector):
    """Each cached or table price at scrape time: value, age, stale flag."""

    def __init__(self, prices: PriceBook | None) -> None:
        self.prices = prices

    def collect(self) -> Any:
        value = GaugeMetricFamily(
            "prfaas_price_usd_per_gpu_hour", "current $/GPU-hour", labels=["region", "market", "source"]
        )
        age = GaugeMetricFamily("prfaas_price_age_seconds", "age of the cached price", labels=["region", "market"])
        stale = GaugeMetricFamily("prfaas_price_stale", "1: older than max_age_s", labels=["region", "market"])
        try:
            quotes = self.prices.quotes() if self.prices is not None else []
        except Exception:  # a scrape must not fail because Redis blinked
            quotes = []
        for q in quotes:
            value.add_metric([q.region, q.market, q.source], q.usd_per_gpu_hour)
            age.add_metric([q.region, q.market], q.age_s or 0.0)
            stale.add_metric([q.region, q.market], float(q.stale))
        yield from (value, age, stale)
