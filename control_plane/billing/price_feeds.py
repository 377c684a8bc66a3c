"""The live GPU price feeds, through boto3: EC2 spot price history for a region's GPU instance type, and the
AWS Price List API for its on-demand price. Mechanism only (one call each, one try, the timeouts of
`Settings.aws`); `PriceBook.refresh` (billing/prices.py) caches what they say, or the table on error.

    feed = PriceFeed(settings.aws, settings.pricing)
    feed.spot(region_prices), feed.on_demand(region_prices)   # $/GPU-hour, or PriceFeedError
"""

from __future__ import annotations

import datetime as dt
import json
import math
from typing import Any

from prfaas.control_plane.billing.prices import PriceFeedError, RegionPrices
from prfaas.control_plane.settings import AwsSection, PricingSection


class PriceFeed:
    """The live feeds, through boto3. One client per (service, AWS region), kept."""

    def __init__(self, aws: AwsSection, pricing: PricingSection) -> None:
        self.aws = aws
        self.pricing = pricing
        self._clients: dict[tuple[str, str], Any] = {}

    def _client(self, service: str, region: str) -> Any:
        import boto3
        from botocore.config import Config

        key = (service, region)
        if key not in self._clients:
            endpoint = self.aws.endpoint_url if service == "ec2" else self.pricing.endpoint_url
            cfg = Config(
                connect_timeout=self.aws.timeout_s, read_timeout=self.aws.timeout_s, retries={"max_attempts": 1}
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
        pricing = self._client("pricing", self.pricing.region)
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
        if not (math.isfinite(price) and price > 0):
            continue  # a price no market quotes: not this zone's
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
                    if math.isfinite(price) and price > 0:
                        return price
    raise PriceFeedError("no hourly on-demand USD price in the Price List reply")
