"""The monthly spend in Redis against the ledger, where money went wrong before (real Redis, the ledger in a
SQLite file): a reconciliation sync that reads the ledger between a biller's write and its settle counts
the entry once, not twice; a bill lands in the month its job finished, as the ledger counts it; a live price
that is negative, NaN or infinite is refused for the table's. (A job that cannot be priced stopping no other
tenant's reconciliation: test_usage_e2e.py.)"""

from __future__ import annotations

import datetime as dt
import json
import math
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from cp_kit import settings_fixture

from prfaas.control_plane.billing.costs import JobUsage, PriceTable
from prfaas.control_plane.billing.ledger import Ledger
from prfaas.control_plane.billing.price_feeds import parse_on_demand, parse_spot
from prfaas.control_plane.billing.prices import PriceBook, PriceConfig
from prfaas.control_plane.billing.spend import TenantSpend
from prfaas.control_plane.jobs.store import JobStore
from prfaas.control_plane.settings import Settings

PRICES = PriceTable(gpu_hour_usd={"r": 3.6})


@pytest.fixture
def settings() -> Iterator[Settings]:
    yield from settings_fixture()


@pytest.fixture
def ledger(tmp_path: Path) -> Iterator[Ledger]:
    led = Ledger(f"sqlite:///{tmp_path / 'ledger.db'}")
    yield led
    led.close()


def _usage(tenant: str, finished_at: dt.datetime) -> JobUsage:
    return JobUsage(job_id=str(uuid.uuid4()), tenant=tenant, model="m", prefill_region="r", decode_region="r",
                    prefill_gpu_s=0.0, decode_gpu_s=1.0, tokens_in=10, tokens_out=5, kv_bytes_raw=0,
                    kv_bytes_wire=0, finished_at=finished_at)  # fmt: skip


def test_a_sync_between_a_write_and_its_settle_counts_the_entry_once(settings: Settings, ledger: Ledger) -> None:
    client = redis.Redis.from_url(settings.redis_url)
    jobs = JobStore(client, settings)
    spend = TenantSpend(client, jobs)
    tenant = "t-" + uuid.uuid4().hex[:8]
    with spend.settling([tenant]) as lease:
        [(entry, inserted)] = ledger.record_many([(_usage(tenant, dt.datetime.now(dt.UTC)), PRICES)])
        assert inserted and entry.total_usd == pytest.approx(0.001)
        assert not spend.sync(tenant, ledger)  # the sweep lands here: it leaves the spend to the settle
        assert jobs.spend(tenant) == 0.0
        assert spend.settle([(tenant, entry.job_id, entry.total_usd, entry.finished_at)], lease) == {}
    assert jobs.spend(tenant) == pytest.approx(0.001)
    assert spend.sync(tenant, ledger)  # and later sweeps agree with the ledger
    assert jobs.spend(tenant) == pytest.approx(0.001)


def test_a_bill_lands_in_the_month_its_job_finished(settings: Settings, ledger: Ledger) -> None:
    """A job that finished in the last seconds of a month and is billed in the next counts in its own month,
    as the ledger counts it; the new month's budget starts empty."""
    client = redis.Redis.from_url(settings.redis_url)
    jobs = JobStore(client, settings)
    spend = TenantSpend(client, jobs)
    tenant = "t-" + uuid.uuid4().hex[:8]
    this_month = dt.datetime.now(dt.UTC).replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    last_second = this_month - dt.timedelta(seconds=2)
    with spend.settling([tenant]) as lease:
        [(entry, _)] = ledger.record_many([(_usage(tenant, last_second), PRICES)])
        spend.settle([(tenant, entry.job_id, entry.total_usd, entry.finished_at)], lease)
    assert jobs.spend(tenant) == 0.0  # this month's key
    previous = client.get(jobs.spend_key(tenant, last_second.timestamp()))
    assert previous is not None and float(previous) == pytest.approx(0.001)


class BadFeed:
    """A price feed that answers what no market quotes."""

    def __init__(self, usd: float) -> None:
        self.usd = usd

    def on_demand(self, conf: Any) -> float:
        return self.usd

    def spot(self, conf: Any) -> float:
        return self.usd


@pytest.mark.parametrize("usd", [-0.9, math.nan, math.inf, 0.0])
def test_a_live_price_that_is_not_a_positive_finite_number_is_refused_for_the_table(
    settings: Settings, usd: float
) -> None:
    client = redis.Redis.from_url(settings.redis_url)
    config = PriceConfig.model_validate({"regions": {"p": {"usd_per_gpu_hour": 2.0, "spot_usd_per_gpu_hour": 1.0,
                                                           "instance_type": "p4d.24xlarge"}}})  # fmt: skip
    book = PriceBook(client, settings.key("prices"), config, local_ttl_s=0.0)
    quotes = {q.market: q for q in book.refresh(BadFeed(usd))}
    assert (quotes["on-demand"].source, quotes["on-demand"].usd_per_gpu_hour) == ("table", 2.0)
    assert (quotes["spot"].source, quotes["spot"].usd_per_gpu_hour) == ("table", 1.0)
    # a bad price already in the cache (written by an older process) is not used either
    client.hset(settings.key("prices"), "p|spot", json.dumps({"usd": -1.0, "source": "aws-spot", "fetched_at": 0}))
    assert book.spot("p") == 1.0


def test_the_parsers_skip_prices_no_market_quotes() -> None:
    history = {"SpotPriceHistory": [
        {"InstanceType": "x", "AvailabilityZone": "a", "Timestamp": 1, "SpotPrice": "-1"},
        {"InstanceType": "x", "AvailabilityZone": "b", "Timestamp": 1, "SpotPrice": "NaN"},
        {"InstanceType": "x", "AvailabilityZone": "c", "Timestamp": 1, "SpotPrice": "2.5"},
    ]}  # fmt: skip
    assert parse_spot(history, "x") == 2.5
    product = {"terms": {"OnDemand": {"t": {"priceDimensions": {
        "d1": {"unit": "Hrs", "pricePerUnit": {"USD": "Infinity"}},
        "d2": {"unit": "Hrs", "pricePerUnit": {"USD": "4.0"}},
    }}}}}  # fmt: skip
    assert parse_on_demand({"PriceList": [json.dumps(product)]}) == 4.0
