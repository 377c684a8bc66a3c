"""The threads the API's waits run on. Reading a job's tokens blocks a thread (the follower reads Redis): an
answer being built (`stream=false`) holds one for the whole job, a stream one while it waits for its next
token. Those waits take threads of their own (`waiting`, at most `max_waiting_requests` at once; more queue for
one), and canceling the jobs of clients gone another (`gone`): the default pool, which runs every sync route
(`/readyz`, admission, the admin routes), never waits behind them. With the default pool's 40 threads, 40 slow
prefills used to stall every route, health probes included."""

from __future__ import annotations

from typing import Any

import anyio
from anyio.lowlevel import RunVar
from starlette.types import Scope

from prfaas.control_plane.settings import Settings

_WAITING: RunVar[anyio.CapacityLimiter] = RunVar("prfaas_waiting_limiter")
_GONE: RunVar[anyio.CapacityLimiter] = RunVar("prfaas_gone_limiter")


def waiting(scope: Scope) -> anyio.CapacityLimiter:
    """The threads of the waits on jobs' tokens (one limiter per event loop, made on it, sized by the app's
    settings)."""
    try:
        return _WAITING.get()
    except LookupError:
        app: Any = scope.get("app")
        settings = getattr(getattr(app, "state", None), "settings", None)
        size = getattr(settings, "max_waiting_requests", None) or Settings.model_fields["max_waiting_requests"].default
        limiter = anyio.CapacityLimiter(size)
        _WAITING.set(limiter)
        metrics = getattr(getattr(app, "state", None), "api_metrics", None)
        if metrics is not None:  # prfaas_api_waiting_requests / _queued
            metrics.watch_waiting(limiter)
        return limiter


def gone() -> anyio.CapacityLimiter:
    """The threads that cancel the jobs of clients gone (one limiter per event loop, made on it): under load
    every waiting thread may be reading a job, and a cancel must not wait for one of them to end."""
    try:
        return _GONE.get()
    except LookupError:
        limiter = anyio.CapacityLimiter(16)
        _GONE.set(limiter)
        return limiter
