"""The worker's watcher holds the prefill regions' event streams (control_plane/jobs/watcher.py): a region that
hangs without closing its connection (SIGSTOP, a partition) breaks its stream within a keepalive interval and an
ack's wait, UNAVAILABLE, so its attempt fails over. Before, the stream waited for its call's deadline (the lease
+ 5 s, 30 s at least), the job's decode region idle. The hang is a TCP proxy that stops forwarding."""

from __future__ import annotations

import time
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from link_kit import FreezingProxy

from prfaas.control_plane.jobs import watcher as watcher_module
from prfaas.control_plane.jobs.watcher import Watcher
from prfaas.region.channels import CONNECT_TIMEOUT_FLOOR_MS

INTERVAL_S = 0.5


def test_a_hung_regions_stream_breaks_within_seconds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(watcher_module, "KEEPALIVE_S", INTERVAL_S)
    server = grpc.server(futures.ThreadPoolExecutor(2))
    servicer = health.HealthServicer()
    servicer.set("prfaas", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    proxy = FreezingProxy(f"127.0.0.1:{port}")
    watcher = Watcher(None)

    async def follow() -> tuple[str, float]:
        """A long stream (Watch answers once, then only on a change): read its first event, then hang the link."""
        stub = health_pb2_grpc.HealthStub(watcher.channel(proxy.address, "prefill-a"))
        call = stub.Watch(health_pb2.HealthCheckRequest(service="prfaas"), timeout=60)
        async for _ in call:
            break
        proxy.freeze()
        frozen = time.monotonic()
        try:
            async for _ in call:
                pass
        except grpc.aio.AioRpcError as exc:
            return exc.code().name, time.monotonic() - frozen
        return "ended", time.monotonic() - frozen

    try:
        code, took_s = watcher.submit(follow()).result(timeout=70)
        assert code == "UNAVAILABLE", (code, took_s)
        assert took_s < 2 * INTERVAL_S + CONNECT_TIMEOUT_FLOOR_MS / 1000 + 2, took_s
    finally:
        proxy.close()
        server.stop(0)
