"""GPU prices: a table in configuration and live feeds through boto3 (EC2 spot price history for each region's
GPU instance type, the AWS Price List API for on-demand), refreshed on a schedule (the Celery beat task
`prfaas.refresh_prices`), cached in Redis with the source and age of every price.

Mechanism only: `PriceFeed` (billing/price_feeds.py) does the AWS calls, `PriceBook` the cache. The scheduler's
snapshot and the ledger read prices through `PriceBook.on_demand` / `PriceBook.spot` (an in-process copy of the
cache, re-read every `local_ttl_s`, so deciding a placement costs no extra Redis round trip most of the time).

A feed error (AWS unreachable, throttled, an instance type it does not price) is logged as a warning and the
region's configured table price is cached in its place, with `source="table"` and the error beside it. A cached
price older than `max_age_s` is `stale`: still used (it is the last price known), and flagged in
`GET /admin/prices`, the dashboard and `prfaas_price_stale`.

Configuration: YAML at `PRFAAS_PRICES_PATH` (`Settings.prices.path`):

    max_age_s: 900          # a cached price older than this is stale
    refresh_s: 300          # the beat task's period
    regions:
      prefill-a: {usd_per_gpu_hour: 1.2, aws_region: us-east-2, instance_type: p4d.24xlarge, gpus_per_instance: 8,
                  location: "US East (Ohio)", spot_usd_per_gpu_hour: 0.9}
      decode-b: {usd_per_gpu_hour: 4.0}   # no instance type: the table price only
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    from prfaas.control_plane.billing.price_feeds import PriceFeed

log = logging.getLogger(__name__)
Market = Literal["on-demand", "spot"]
MARKETS: tuple[Market, ...] = ("on-demand", "spot")


class PriceFeedError(Exception):
    """A live feed gave no usable price (no offer, nothing parsable, nothing to ask for)."""


class RegionPrices(BaseModel):
    model_config = ConfigDict(extra="forbid")

    usd_per_gpu_hour: float = Field(ge=0, allow_inf_nan=False, description="table on-demand price, $/GPU-hour")
    spot_usd_per_gpu_hour: float | None = Field(default=None, ge=0, allow_inf_nan=False, description="table spot")
    aws_region: str | None = Field(default=None, description="AWS region of the live feeds, e.g. us-east-1")
    instance_type: str | None = Field(default=None, description="GPU instance type, e.g. p4d.24xlarge")
    gpus_per_instance: int = Field(default=1, ge=1)
    location: str | None = Field(default=None, description='Price List location, e.g. "US East (N. Virginia)"')


class PriceConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_age_s: float = Field(default=900.0, gt=0)
    refresh_s: float = Field(default=300.0, gt=0)
    regions: dict[str, RegionPrices] = Field(default_factory=dict)

    @classmethod
    def load(cls, path: Path | None) -> PriceConfig:
        if path is None:
            return cls()
        return cls.model_validate(yaml.safe_load(Path(path).read_text()) or {})


@dataclass(frozen=True)
class Quote:
    region: str
    market: Market
    usd_per_gpu_hour: float
    source: str  # "aws-spot", "aws-pricelist" or "table"
    fetched_at: float | None  # epoch s; None: straight from the table, never refreshed
    age_s: float | None
    stale: bool
    error: str | None = None  # why a live feed fell back to the table


class PriceBook:
    """Cached prices in Redis (`p:prices` hash, field `{region}|{market}` -> JSON) over the configured table."""

    def __init__(
        self, client: Any, key: str, config: PriceConfig, *, local_ttl_s: float = 2.0, clock: Any = time.time
    ) -> None:
        self.redis: Any = client
        self.key = key
        self.config = config
        self.local_ttl_s = local_ttl_s
        self._clock = clock
        self._lock = threading.Lock()
        self._local: tuple[float, dict[str, dict[str, Any]]] = (-1e18, {})

    def refresh(self, feed: PriceFeed) -> list[Quote]:
        """Ask the feeds for every configured region and market; cache what they say, or the table on error."""
        now = self._clock()
        entries: dict[str, str] = {}
        for region, conf in sorted(self.config.regions.items()):
            for market in MARKETS:
                table = conf.usd_per_gpu_hour if market == "on-demand" else conf.spot_usd_per_gpu_hour
                if not conf.instance_type and table is None:
                    continue
                entry: dict[str, Any] = {"fetched_at": now}
                try:
                    if not conf.instance_type:
                        raise PriceFeedError("no instance_type configured")
                    usd = feed.on_demand(conf) if market == "on-demand" else feed.spot(conf)
                    if not (isinstance(usd, int | float) and math.isfinite(usd) and usd > 0):
                        raise PriceFeedError(f"the feed's price {usd!r} is not a positive finite number")
                    entry |= {"usd": usd, "source": "aws-pricelist" if market == "on-demand" else "aws-spot"}
                except Exception as exc:  # any feed failure (botocore, parse, network) falls back to the table
                    if table is None:
                        log.warning("%s price of %s unavailable (%s); no table price either", market, region, exc)
                        continue
                    if conf.instance_type:
                        log.warning("%s price of %s from AWS failed (%s); using the table", market, region, exc)
                    entry |= {"usd": table, "source": "table", "error": f"{type(exc).__name__}: {exc}"[:300]}
                entries[f"{region}|{market}"] = json.dumps(entry)
        if entries:
            self.redis.hset(self.key, mapping=entries)
        with self._lock:
            self._local = (-1e18, {})
        return self.quotes()

    def _cached(self) -> dict[str, dict[str, Any]]:
        now = time.monotonic()
        with self._lock:
            at, cached = self._local
            if now - at < self.local_ttl_s:
                return cached
        raw = self.redis.hgetall(self.key)
        cached = {_text(k): json.loads(v) for k, v in raw.items()}
        with self._lock:
            self._local = (now, cached)
        return cached

    def quote(self, region: str, market: Market) -> Quote | None:
        entry = self._cached().get(f"{region}|{market}")
        if entry is not None and not _price(entry.get("usd")):
            log.warning("cached %s price of %s is %r, not a positive finite number: using the table", market, region,
                        entry.get("usd"))  # fmt: skip
            entry = None
        if entry is not None:
            age = max(0.0, self._clock() - float(entry["fetched_at"]))
            return Quote(
                region, market, float(entry["usd"]), str(entry["source"]), float(entry["fetched_at"]), age,
                age > self.config.max_age_s, entry.get("error"),
            )  # fmt: skip
        conf = self.config.regions.get(region)
        if conf is None:
            return None
        table = conf.usd_per_gpu_hour if market == "on-demand" else conf.spot_usd_per_gpu_hour
        return None if table is None else Quote(region, market, table, "table", None, None, False)

    def on_demand(self, region: str) -> float | None:
        q = self.quote(region, "on-demand")
        return None if q is None else q.usd_per_gpu_hour

    def spot(self, region: str) -> float | None:
        q = self.quote(region, "spot")
        return None if q is None else q.usd_per_gpu_hour

    def quotes(self) -> list[Quote]:
        names = set(self.config.regions) | {k.split("|", 1)[0] for k in self._cached()}
        found = [self.quote(region, market) for region in sorted(names) for market in MARKETS]
        return [q for q in found if q is not None]


def quote_dict(q: Quote) -> dict[str, Any]:
    return {
        "region": q.region, "market": q.market, "usd_per_gpu_hour": q.usd_per_gpu_hour, "source": q.source,
        "fetched_at": q.fetched_at, "age_s": q.age_s, "stale": q.stale, "error": q.error,
    }  # fmt: skip


def price_book(client: Any, key: str, path: Path | None) -> PriceBook:
    """The price book at Redis hash `key` over the table at `path` (`Settings.prices.path`; None: no table)."""
    return PriceBook(client, key, PriceConfig.load(path))


def _price(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
