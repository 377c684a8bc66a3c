"""Named FastAPI dependencies: the services, the meter, the job follower, the caller's tenant, the admin
check, the metrics scraper's, and what a generation route needs besides its body (`GenerationDep`).

FastAPI runs a plain `def` dependency in its thread pool (a thread hop each, per request), so these are
all `async def`: they read the app's state, compare a key, or look the tenant up with the asyncio Redis
client on the event loop. A sync route then costs one thread hop, its own."""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Header, Request

from prfaas.control_plane.api.errors import (
    ADMIN_REQUIRED,
    INVALID_API_KEY,
    MISSING_API_KEY,
    SHUTTING_DOWN,
    TENANT_SUSPENDED,
)
from prfaas.control_plane.api.metrics import ApiMetrics
from prfaas.control_plane.api.openai_schemas import Placement
from prfaas.control_plane.billing.meter import Meter
from prfaas.control_plane.jobs.generation import Follower
from prfaas.control_plane.services import Services
from prfaas.control_plane.settings import Settings
from prfaas.control_plane.tenants import Tenant, TenantStatus


async def services(request: Request) -> Services:
    found: Services = request.app.state.services
    return found


async def follower(request: Request) -> Follower:
    found: Follower = request.app.state.follower
    return found


async def meter(request: Request) -> Meter:
    found: Meter = request.app.state.meter
    return found


ServicesDep = Annotated[Services, Depends(services)]
FollowerDep = Annotated[Follower, Depends(follower)]
MeterDep = Annotated[Meter, Depends(meter)]


def _bearer(request: Request) -> str:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise MISSING_API_KEY.error()
    return token.strip()


async def tenant(request: Request, s: ServicesDep) -> Tenant:
    found = await s.tenants.authenticate_async(_bearer(request))
    if found is None:
        raise INVALID_API_KEY.error()
    if found.status is TenantStatus.SUSPENDED:
        raise TENANT_SUSPENDED.error()
    return found


async def admin(request: Request, s: ServicesDep) -> None:
    token = _bearer(request)
    if not hmac.compare_digest(token.encode(), s.settings.admin_key.get_secret_value().encode()):
        raise ADMIN_REQUIRED.error()


async def scraper(request: Request) -> None:
    """The API's `/metrics` (it names tenants): the admin key or `metrics_token`, else 401. Each key is
    compared in constant time, and both always are: the time taken says nothing of which one matched."""
    token = _bearer(request).encode()
    settings: Settings = request.app.state.settings
    keys = [k.get_secret_value().encode() for k in (settings.admin_key, settings.metrics_token) if k is not None]
    matches = [hmac.compare_digest(token, key) for key in keys]  # every one compared: no short cut
    if not any(matches):
        raise INVALID_API_KEY.error()


TenantDep = Annotated[Tenant, Depends(tenant)]
AdminDep = Depends(admin)
ScraperDep = Depends(scraper)


@dataclass(frozen=True)
class Generation:
    """What a generation route (`/v1/completions`, `/v1/chat/completions`) needs besides its body: the caller,
    the services, the follower, the API's metrics, and the headers it honours (`Idempotency-Key`,
    `X-Prfaas-Placement`)."""

    tenant: Tenant
    services: Services
    follower: Follower
    metrics: ApiMetrics
    idempotency_key: str | None
    placement: Placement | None  # the header; None: the body's `prfaas.placement`, else auto


async def generation(
    request: Request,
    tenant: TenantDep,
    s: ServicesDep,
    f: FollowerDep,
    idempotency_key: str | None = Header(default=None, max_length=256),
    x_prfaas_placement: Placement | None = Header(default=None),
) -> Generation:
    if request.app.state.drain.draining:  # this process shuts down (api/shutdown.py): another one answers
        raise SHUTTING_DOWN.error()
    metrics: ApiMetrics = request.app.state.api_metrics
    return Generation(tenant, s, f, metrics, idempotency_key, x_prfaas_placement)


GenerationDep = Annotated[Generation, Depends(generation)]
