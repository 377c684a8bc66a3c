"""`create_app(settings)`: the control plane's FastAPI application, the API process (its routers:
control_plane/api/; the dashboard: control_plane/dashboard/). The lifespan opens the services (Redis,
tokenizer, schedulers), the meter, the Celery producer and, when `registry_listen` is set, the region
registry's gRPC server (control_plane/fleet/server.py).

    uvicorn --factory prfaas.control_plane.app:app_from_env
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import redis
import redis.asyncio
from fastapi import FastAPI, Request, Response
from fastapi.telemetry import TelemetryConfig
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from prfaas.control_plane import dashboard
from prfaas.control_plane.api import completions, errors, extras, jobs, prices, regions, tenants, usage
from prfaas.control_plane.api.body_limit import BodyLimit
from prfaas.control_plane.api.deps import ScraperDep
from prfaas.control_plane.api.errors import SHUTTING_DOWN, STORE_UNAVAILABLE
from prfaas.control_plane.api.metrics import ApiMetrics
from prfaas.control_plane.api.shutdown import Drain
from prfaas.control_plane.billing.meter import open_meter
from prfaas.control_plane.fleet.server import serve_registry
from prfaas.control_plane.jobs.celery_app import make_celery
from prfaas.control_plane.jobs.generation import Follower
from prfaas.control_plane.jobs.leases import Heartbeats
from prfaas.control_plane.services import Services
from prfaas.control_plane.settings import Settings
from prfaas.telemetry import tracing

log = logging.getLogger(__name__)


def create_app(settings: Settings) -> FastAPI:
    traced = tracing.configure("prfaas-api")  # as the environment says (telemetry/tracing.py)
    metrics = CollectorRegistry()
    api_metrics = ApiMetrics(metrics)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        services = Services.create(settings)
        _ = services.model.tokenizer  # load once, before the first request
        auth_redis = redis.asyncio.Redis.from_url(settings.redis_url, socket_timeout=10, socket_connect_timeout=5)
        services.tenants.use_async(auth_redis)  # on this event loop: the tenant lookup costs no thread hop
        celery = make_celery(settings)
        app.state.services = services
        app.state.api_metrics = api_metrics
        app.state.meter = meter = open_meter(services, metrics)
        # A tenant cached anew (Redis restarted empty, or its entry aged out): its month's spend in Redis rises
        # to the ledger's sum before its request is admitted, so an emptied Redis never resets a budget. Installed
        # before `warm`, which runs it for every tenant it caches.
        services.tenants.on_fill = lambda t: meter.spend.sync(t.id, meter.ledger)
        try:
            log.info("tenant cache warmed: %d keys", services.tenants.warm())
        except redis.RedisError as exc:  # each key is cached at its first request instead
            log.warning("tenant cache not warmed (%s)", exc)
        beats = Heartbeats(services.redis, settings, "api").start()  # its jobs are swept if it stops beating
        app.state.follower = follower = Follower(services, celery, meter, beats.me)
        app.state.drain = drain = Drain(follower, settings.shutdown_timeout_s)  # on SIGTERM (api/shutdown.py)
        drain.install_signals()
        api_metrics.watch_drain(follower.streaming, lambda: drain.draining)  # prfaas_api_jobs_streaming, _draining
        server = None
        if settings.registry_listen:
            server, address = serve_registry(services.regions, settings.registry_listen, settings.tls)
            app.state.registry_address = address
            log.info("region registry on %s", address)
        yield
        drain.stop()  # the server no longer serves: a job still streamed here ends (its client has gone)
        if server is not None:
            server.stop(1)
        beats.stop()
        meter.close()
        meter.ledger.close()
        services.tenants.use_async(None)
        await auth_redis.aclose()
        services.close()

    # FastAPI's HTTP span (it continues a client's traceparent) holds the job's when tracing is on, without its
    # per-operation spans (each SDK span costs the API ~0.1 ms of CPU); off, its instrumentation is skipped
    telemetry = TelemetryConfig(tracing=traced, operation_spans=False, metrics=False, logs=False)
    app = FastAPI(title="prfaas control plane", version="1", lifespan=lifespan, telemetry=telemetry)
    app.state.settings = settings
    for router in (completions.router, extras.router, jobs.router, tenants.router, regions.router, usage.router):
        app.include_router(router)
    app.include_router(usage.admin_router)
    app.include_router(prices.router)
    dashboard.install(app)

    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    errors.install(app)
    # outermost, around Starlette's ServerErrorMiddleware too (`add_middleware` puts it inside): counts early 413s
    # and the 500s of unhandled errors
    stack = app.build_middleware_stack
    app.build_middleware_stack = lambda: CountResponses(stack(), counter=api_metrics.responses)  # type: ignore[method-assign]

    @app.get("/healthz", tags=["ops"])
    async def healthz() -> dict[str, str]:  # on the event loop: no thread to wait for
        return {"status": "ok"}

    @app.get("/readyz", tags=["ops"])
    def readyz(request: Request) -> dict[str, str]:
        services: Services = request.app.state.services
        if request.app.state.drain.draining:  # a load balancer sends no more requests here
            raise SHUTTING_DOWN.error()
        try:
            services.redis.ping()
        except redis.RedisError:
            raise STORE_UNAVAILABLE.error() from None
        return {"status": "ready"}

    @app.get("/metrics", tags=["ops"], dependencies=[ScraperDep])  # tenant ids label its job histograms
    def prometheus() -> Response:
        return Response(generate_latest(metrics), media_type=CONTENT_TYPE_LATEST)

    return app


class CountResponses:
    """Counts responses by route and status. A plain ASGI middleware: Starlette's
    `BaseHTTPMiddleware` (`@app.middleware`) costs a task and two memory streams per request."""

    def __init__(self, app: ASGIApp, counter: Counter) -> None:
        self.app = app
        self.counter = counter

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                route = scope.get("route")
                self.counter.labels(getattr(route, "path", "unmatched"), str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)


def app_from_env() -> FastAPI:
    return create_app(Settings())  # type: ignore[call-arg]
