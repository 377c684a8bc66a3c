"""Named FastAPI dependencies: the services, the caller's tenant, the admin check.

FastAPI runs a plain `def` dependency in its thread pool (a thread hop each, per request), so these are
all `async def`: they read the app's state, compare a key, or look the tenant up with the asyncio Redis
client on the event loop. A sync route then costs one thread hop, its own."""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends, HTTPException, Request

from prfaas.control_plane.jobs.generation import Follower
from prfaas.control_plane.services import Services
from prfaas.control_plane.tenants import Tenant, TenantStatus


async def services(request: Request) -> Services:
    found: Services = request.app.state.services
    return found


async def follower(request: Request) -> Follower:
    found: Follower = request.app.state.follower
    return found


ServicesDep = Annotated[Services, Depends(services)]
FollowerDep = Annotated[Follower, Depends(follower)]


def _bearer(request: Request) -> str:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise HTTPException(401, "missing API key", headers={"WWW-Authenticate": "Bearer"})
    return token.strip()


async def tenant(request: Request, s: ServicesDep) -> Tenant:
    found = await s.tenants.authenticate_async(_bearer(request))
    if found is None:
        raise HTTPException(401, "invalid API key", headers={"WWW-Authenticate": "Bearer"})
    if found.status is TenantStatus.SUSPENDED:
        raise HTTPException(403, "tenant suspended")
    return found


async def admin(request: Request, s: ServicesDep) -> None:
    token = _bearer(request)
    if not hmac.compare_digest(token.encode(), s.settings.admin_key.get_secret_value().encode()):
        raise HTTPException(403, "admin key required")


TenantDep = Annotated[Tenant, Depends(tenant)]
AdminDep = Depends(admin)
