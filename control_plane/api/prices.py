"""Prices (admin key): `GET /admin/prices` lists every price with its source, age and stale flag;
`POST /admin/prices/refresh` asks the live feeds now (the beat task does it every `refresh_s`)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from prfaas.control_plane.api.deps import AdminDep, MeterDep
from prfaas.control_plane.billing.price_feeds import PriceFeed
from prfaas.control_plane.billing.prices import quote_dict

router = APIRouter(prefix="/admin", tags=["admin"], dependencies=[AdminDep])


@router.get("/prices")
def admin_prices(m: MeterDep) -> list[dict[str, Any]]:
    """Every price with its source (`aws-spot`, `aws-pricelist`, `table`), age and stale flag."""
    return [quote_dict(q) for q in m.prices.quotes()]


@router.post("/prices/refresh")
def refresh_prices(m: MeterDep) -> list[dict[str, Any]]:
    """Refresh now (the beat task does it every `refresh_s`)."""
    return [quote_dict(q) for q in m.prices.refresh(PriceFeed(m.s.settings.aws, m.s.settings.pricing))]
