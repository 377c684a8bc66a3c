"""Celery side of metering: the beat schedule and its tasks. `prfaas.refresh_prices` asks the live feeds for
every configured price (every `refresh_s` of the price configuration); `prfaas.reconcile_ledger` bills DONE
jobs left without an entry and records the wasted attempts of failed ones (every minute). Run the schedule with
`celery -A prfaas.control_plane.worker beat` (or a worker with `-B`)."""

from __future__ import annotations

import functools
import logging
from typing import Any

from celery import Celery

from prfaas.control_plane.billing.price_feeds import PriceFeed
from prfaas.control_plane.billing.prices import PriceConfig
from prfaas.control_plane.settings import Settings

log = logging.getLogger(__name__)
REFRESH_PRICES = "prfaas.refresh_prices"
RECONCILE_LEDGER = "prfaas.reconcile_ledger"
RECONCILE_EVERY_S = 60.0


def configure(app: Celery, settings: Settings, *, worker: bool) -> None:
    config = PriceConfig.load(settings.prices.path)
    app.conf.beat_schedule = {
        "refresh-prices": {"task": REFRESH_PRICES, "schedule": config.refresh_s},
        "reconcile-ledger": {"task": RECONCILE_LEDGER, "schedule": RECONCILE_EVERY_S},
    }
    if not worker:
        return

    @functools.cache
    def meter() -> Any:  # opened at the first task, once per worker process
        from prfaas.control_plane.billing.meter import open_meter
        from prfaas.control_plane.services import Services

        return open_meter(Services.create(settings))

    feed = PriceFeed(settings.aws, settings.pricing)

    @app.task(name=REFRESH_PRICES)  # type: ignore[untyped-decorator]
    def refresh_prices() -> list[str]:
        quotes = meter().prices.refresh(feed)
        return [f"{q.region} {q.market} {q.usd_per_gpu_hour:.4f} {q.source}" for q in quotes]

    @app.task(name=RECONCILE_LEDGER)  # type: ignore[untyped-decorator]
    def reconcile_ledger() -> int:
        from prfaas.control_plane.billing.reconcile import reconcile

        return reconcile(meter())
