"""GPU prices: a table in configuration and live feeds through boto3 (EC2 spot price history for each region's
GPU instance type, the AWS Price List API for on-demand), refreshed on a schedule (the Celery beat task
`prfaas.refresh_prices`), cached in Redis with the source and age of every price.

Mechanism only: `PriceFeed` does the AWS calls, `PriceBook` the cache. The scheduler's snapshot and the ledger
read prices through `PriceBook.on_demand` / `PriceBook.spot` (an in-process copy of the cache, re-read every
`local_ttl_s`, so deciding a placement costs no extra Redis round trip most of the time).

A feed error (AWS unreachable, throttled, an instance type it does not price) is logged as a warning and the
region's configured table price is cached in its place, with `source="table"` and the error beside it. A cached
price older than `max_age_s` is `stale`: still used (it is the last price known), and flagged in
`GET /admin/prices`, the dashboard and `prfaas_price_stale`.

Configuration: YAML at `PRFAAS_PRICES_PATH`:

    max_age_s: 900          # a cached price older than this is stale
    refresh_s: 300          # the beat task's period
    regions:
      prefill-a: {usd_per_gpu_hour: 1.2, aws_region: us-east-2, instance_type: p4d.24xlarge, gpus_per_instance: 8,
                  location: "US East (Ohio)", spot_usd_per_gpu_hour: 0.9}
      decode-b: {usd_per_gpu_hour: 4.0}   # no instance type: the table price only
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

log = logging.getLogger(__name__)
Market = Literal["on-demand", "spot"]
MARKETS: tuple[Market, ...] = ("on-demand", "spot")


class PriceFeedError(Exception):
    """A live feed gave no usable price (no offer, nothing parsable)."""


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


class PriceSettings(BaseSettings):
    """`PRFAAS_PRICES_PATH`, `PRFAAS_AWS_ENDPOINT_URL` (EC2; moto's server in tests), `PRFAAS_PRICING_ENDPOINT_URL`
    (Price List; a loopback server of recorded responses in tests)."""

    model_config = SettingsConfigDict(env_prefix="PRFAAS_", extra="ignore", frozen=True)

    prices_path: Path | None = None
    aws_endpoint_url: str | None = None
    pricing_endpoint_url: str | None = None
    pricing_region: str = "us-east-1"  # the Price List API is served from us-east-1 (and ap-south-1)
    aws_timeout_s: float = Field(default=5.0, gt=0)


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


class PriceFeed:
    """The live feeds, through boto3. One client per (service, AWS region), kept."""

    def __init__(self, settings: PriceSettings) -> None:
        self.settings = settings
        self._clients: dict[tuple[str, str], Any] = {}

    def _client(self, service: str, region: str) -> Any:
        import boto3
        from botocore.config import Config

        key = (service, region)
        if key not in self._clients:
            endpoint = self.settings.aws_endpoint_url if service == "ec2" else self.settings.pricing_endpoint_url
            cfg = Config(
                connect_timeout=self.settings.aws_timeout_s,
                read_timeout=self.settings.aws_timeout_s,
                retries={"max_attempts": 1},
            )
            self._clients[key] = boto3.client(service, region_name=region, endpoint_url=endpoint, config=cfg)
        return self._clients[key]

    def spot(self, prices: RegionPrices) -> float:
        """$/GPU-hour: the lowest of the latest spot price of each availability zone, per GPU."""
        if not (prices.aws_region and prices.instance_type):
            raise PriceFeedError("no aws_region / instance_type configured")
        ec2 = self._client("ec2", prices.aws_region)
        reply = ec2.describe_spot_price_history(
            InstanceTypes=[prices.instance_type],
            ProductDescriptions=["Linux/UNIX"],
            StartTime=dt.datetime.now(dt.UTC) - dt.timedelta(hours=6),
            MaxResults=1000,
        )
        return parse_spot(reply, prices.instance_type) / prices.gpus_per_instance

    def on_demand(self, prices: RegionPrices) -> float:
        """$/GPU-hour from the Price List (Linux, shared tenancy, no pre-installed software)."""
        if not (prices.location and prices.instance_type):
            raise PriceFeedError("no location / instance_type configured")
        pricing = self._client("pricing", self.settings.pricing_region)
        filters = {
            "instanceType": prices.instance_type,
            "location": prices.location,
            "operatingSystem": "Linux",
            "tenancy": "Shared",
            "preInstalledSw": "NA",
            "capacitystatus": "Used",
        }
        reply = pricing.get_products(
            ServiceCode="AmazonEC2",
            Filters=[{"Type": "TERM_MATCH", "Field": k, "Value": v} for k, v in filters.items()],
            MaxResults=10,
        )
        return parse_on_demand(reply) / prices.gpus_per_instance


def parse_spot(reply: dict[str, Any], instance_type: str) -> float:
    """$/instance-hour: the latest price of each zone, the lowest zone."""
    latest: dict[str, tuple[Any, float]] = {}
    for item in reply.get("SpotPriceHistory", []):
        if item.get("InstanceType") != instance_type:
            continue
        zone, at, price = item.get("AvailabilityZone", ""), item.get("Timestamp"), float(item["SpotPrice"])
        if zone not in latest or (at is not None and at > latest[zone][0]):
            latest[zone] = (at, price)
    if not latest:
        raise PriceFeedError(f"no spot price for {instance_type}")
    return min(price for _, price in latest.values())


def parse_on_demand(reply: dict[str, Any]) -> float:
    """$/instance-hour of the first product's hourly on-demand term (Price List documents are JSON strings)."""
    for doc in reply.get("PriceList", []):
        product = json.loads(doc) if isinstance(doc, str) else doc
        for term in product.get("terms", {}).get("OnDemand", {}).values():
            for dim in term.get("priceDimensions", {}).values():
                if dim.get("unit") in ("Hrs", "Hours") and "USD" in dim.get("pricePerUnit", {}):
                    price = float(dim["pricePerUnit"]["USD"])
                    if price > 0:
                        return price
    raise PriceFeedError("no hourly on-demand USD price in the Price List reply")


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


def price_book(client: Any, key: str, settings: PriceSettings | None = None) -> PriceBook:
    settings = settings or PriceSettings()
    return PriceBook(client, key, PriceConfig.load(settings.prices_path))


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
