"""The region's gRPC channel options (region/channels.py) against a peer that goes silent without
closing its connection (a TCP proxy that stops forwarding, its sockets left open): a channel with
`keepalive_options` notices within an interval and 2 s, and its next call takes a new connection.
Before, grpcio waited `grpc.http2.ping_timeout_ms` (60 s by default) for the unanswered keepalive
ping, whatever `keepalive_timeout_ms` said: every call failed for a minute."""

from __future__ import annotations

from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from link_kit import FreezingProxy

from prfaas.devstack.processes import wait_until
from prfaas.region.channels import CONNECT_TIMEOUT_FLOOR_MS, keepalive_options

INTERVAL_S = 0.5


def test_a_silent_peer_is_noticed_within_seconds_not_a_minute() -> None:
    server = grpc.server(futures.ThreadPoolExecutor(2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    proxy = FreezingProxy(f"127.0.0.1:{port}")
    chan = grpc.insecure_channel(proxy.address, options=keepalive_options(INTERVAL_S))
    stub = health_pb2_grpc.HealthStub(chan)

    def answered() -> bool:
        try:
            stub.Check(health_pb2.HealthCheckRequest(), timeout=INTERVAL_S)
            return True
        except grpc.RpcError:
            return False

    try:
        assert answered()
        proxy.freeze()  # the connection stays open and carries nothing
        # a ping within an interval, its ack awaited CONNECT_TIMEOUT_FLOOR_MS, one call's time, a reconnect
        waited_s = wait_until(answered, 3 * INTERVAL_S + CONNECT_TIMEOUT_FLOOR_MS / 1000 + 1)
        assert proxy.num_connections == 2, waited_s  # the answer came on a new connection
    finally:
        chan.close()
        proxy.close()
        server.stop(0)
