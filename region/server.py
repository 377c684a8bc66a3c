"""One region process: a gRPC server hosting the region's agents (prefill, decode or both)
with gRPC health checking, Prometheus /metrics, and heartbeats to the registry.

Agents take plain values (prefill_region.agent, decode_region.agent); `prfaas region`
builds them from a `RegionConfig` and hands them here. Drain (SIGTERM or `drain()`):
health turns NOT_SERVING, heartbeats say draining, new jobs are refused with UNAVAILABLE,
running ones get `drain_timeout_s` to finish, then everything stops.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Protocol

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import start_http_server

from prfaas.engine.device import DeviceChoice
from prfaas.protos.prfaas.v1 import registry_pb2
from prfaas.region.authz import Authorizer, region_policy
from prfaas.region.channels import MAX_PREFIX_BLOCKS, SERVER_OPTIONS, TlsFiles, listen
from prfaas.region.health import MAX_WATCHES, MAX_WATCHES_PER_CALLER, BoundedHealth
from prfaas.region.registry_client import Heartbeater
from prfaas.transport.endpoints import hostport, parse_hostport

if TYPE_CHECKING:
    from prfaas.engine.prefix_cache import Residency

log = logging.getLogger(__name__)
PREFIX_REFRESH_S = 10.0  # resident prefix blocks are sent whole at least this often


class Agent(Protocol):
    draining: bool

    def load(self) -> dict[str, float]: ...

    def link_reports(self) -> list[registry_pb2.LinkReport]:
        """The paths this agent sends KV on, measured since its last heartbeat."""
        ...

    def idle(self) -> bool: ...

    def close(self) -> None: ...


class RegionServer:
    """`agents` maps a gRPC service name (prfaas.v1.PrefillRegion, ...) to the agent and the
    function that adds it to a server (the generated `add_*Servicer_to_server`). `device`: what its
    engine runs on (set by `build_region`; shown on the `ready` line)."""

    device: DeviceChoice | None = None

    def __init__(
        self,
        grpc_address: str,
        agents: dict[str, tuple[Agent, Callable[[Any, grpc.Server], None]]],
        *,
        metrics_address: str | None = None,
        max_rpc_threads: int = 64,
        tls: TlsFiles | None = None,
        prefix_cache: Residency | None = None,
    ) -> None:
        """`tls`: serve mutual TLS, control calls from the control plane's certificate only
        (region/authz.py); None: plaintext (loopback, or a region configured `insecure`).
        `prefix_cache`: the engine's (or a mirror of a vLLM engine's), whose resident blocks heartbeats publish."""
        self.agents = agents
        self.tls = tls
        self.prefix_cache = prefix_cache
        self._published: tuple[int, int, float] = (-1, -1, 0.0)  # (version, registration, time.monotonic())
        # health Watch streams get threads of their own beyond `max_rpc_threads` (region/health.py bounds them)
        self.server = grpc.server(
            ThreadPoolExecutor(max_rpc_threads + MAX_WATCHES, thread_name_prefix="prfaas-rpc"), options=SERVER_OPTIONS,
            interceptors=[Authorizer(region_policy)] if tls is not None else None,
        )  # fmt: skip
        # Blocking health Watch streams (a thread of the RPC pool each; decode regions hold one
        # per prefill region): the non-blocking servicer sends a Watch's first reply holding
        # its lock and waits for the server's completion-queue thread, which may itself wait
        # for that lock to run another Watch's close callback; that stalled every stream of
        # the server (the up/down wedge; test_region_ops.py::test_health_watch_churn_...).
        self.health = health.HealthServicer(experimental_non_blocking=False)
        self.watches = BoundedHealth(self.health, MAX_WATCHES, MAX_WATCHES_PER_CALLER if tls is not None else None)
        health_pb2_grpc.add_HealthServicer_to_server(self.watches, self.server)
        for agent, add in agents.values():
            add(agent, self.server)
        host, port = parse_hostport(grpc_address)
        address = hostport(host, port)  # [v6]:port: grpc binds no bare v6 address
        bound = listen(self.server, address, tls)
        self.grpc_address = hostport(host, bound)
        self.metrics_address: str | None = None
        self._metrics: Any = None
        if metrics_address is not None:
            mhost, mport = parse_hostport(metrics_address)
            self._metrics, _thread = start_http_server(mport, addr=mhost)
            self.metrics_address = hostport(mhost, self._metrics.server_port)
        self.heartbeater: Heartbeater | None = None
        self._stopped = threading.Event()

    def load(self) -> registry_pb2.Load:
        total: dict[str, float] = {}
        for agent, _add in self.agents.values():
            for key, value in agent.load().items():  # counts add up; rates are the same hardware's: the higher
                total[key] = max(total.get(key, 0.0), value) if key.endswith("_per_s") else total.get(key, 0.0) + value
        load = registry_pb2.Load(
            queue_depth=int(total.get("queue_depth", 0)), busy_workers=int(total.get("busy_workers", 0)),
            kv_used_bytes=int(total.get("kv_used_bytes", 0)), kv_free_bytes=int(total.get("kv_free_bytes", 0)),
            prefill_tokens_per_s=total.get("prefill_tokens_per_s", 0.0),
            decode_tokens_per_s=total.get("decode_tokens_per_s", 0.0), draining=self.draining,
            queued_prefill_tokens=int(total.get("queued_prefill_tokens", 0)),
            running_prefill_tokens=int(total.get("running_prefill_tokens", 0)),
            decode_running=int(total.get("decode_running", 0)), decode_slots=int(total.get("decode_slots", 0)),
            mean_job_s=total.get("mean_job_s", 0.0),  # the decode role's alone
            links=[report for agent, _add in self.agents.values() for report in agent.link_reports()],
        )  # fmt: skip
        self._publish_prefix(load)
        return load

    def _publish_prefix(self, load: registry_pb2.Load) -> None:
        """The prefix cache's resident blocks, sent whole when they changed, when the region registered
        anew (a restarted registry knows none), or every PREFIX_REFRESH_S (a lost beat loses no change
        for longer); the beats between carry only the version."""
        cache = self.prefix_cache
        if cache is None:
            return
        version, registrations = cache.version, self.heartbeater.registrations if self.heartbeater else 0
        now = time.monotonic()
        load.prefix_version = version
        if (version, registrations) != self._published[:2] or now - self._published[2] >= PREFIX_REFRESH_S:
            load.prefix_blocks.extend(cache.resident()[:MAX_PREFIX_BLOCKS])  # the registry keeps no more
            load.prefix_included = True
            self._published = (version, registrations, now)

    @property
    def draining(self) -> bool:
        return any(agent.draining for agent, _add in self.agents.values())

    def start(self, heartbeat: tuple[str, registry_pb2.RegisterRequest, float] | None = None) -> None:
        self.server.start()
        for name in ("", *self.agents):
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        if heartbeat is not None:
            target, registration, interval_s = heartbeat
            self.heartbeater = Heartbeater(target, registration, self.load, interval_s, self.tls)
            self.heartbeater.start()
        log.info("region serving gRPC on %s (metrics %s)", self.grpc_address, self.metrics_address or "off")

    def drain(self, timeout_s: float) -> None:
        """Refuse new work, let running work finish within `timeout_s`, then stop."""
        self._refuse_new_work()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not all(agent.idle() for agent, _add in self.agents.values()):
            time.sleep(0.1)
        self.stop()

    def _refuse_new_work(self) -> None:
        for agent, _add in self.agents.values():
            agent.draining = True
        for name in ("", *self.agents):
            self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)

    def stop(self, grace_s: float = 1.0) -> None:
        """Stop now: new work refused, health NOT_SERVING, then a last heartbeat that says draining
        (the registry must not count a stopping region healthy for its next few intervals), then
        the agents close and the server stops."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        self._refuse_new_work()
        if self.heartbeater is not None:
            self.heartbeater.stop()
        for agent, _add in self.agents.values():
            agent.close()
        self.server.stop(grace_s).wait(grace_s + 1.0)
        if self._metrics is not None:
            self._metrics.shutdown()

    def wait(self) -> None:
        self._stopped.wait()
