"""The decode region's watch on prefill regions: one shared health stream per region, every
waiting reservation told once when it breaks, none after it stopped watching."""

from __future__ import annotations

import socket
import threading
import time

import grpc
import pytest
from region_kit import wait_until

from prfaas.decode_region.peer_watch import PeerWatcher
from prfaas.region.server import RegionServer


def test_watches_share_one_stream_and_all_hear_of_its_loss() -> None:
    server = RegionServer("127.0.0.1:0", {})
    server.start()
    watcher = PeerWatcher(0.2)
    lost: dict[str, str] = {}
    lock = threading.Lock()

    def on_lost(name: str):  # type: ignore[no-untyped-def]
        def record(reason: str) -> None:
            with lock:
                assert name not in lost, f"{name} told twice"
                lost[name] = reason

        return record

    try:
        watches = {name: watcher.watch(server.grpc_address, on_lost(name)) for name in "abcd"}
        assert watcher.streams == 1
        wait_until(lambda: watcher.answered(server.grpc_address), 20.0)
        watches["c"].stop()  # its KV arrived: no longer waiting
        server.stop(0)
        wait_until(lambda: len(lost) == 3, 20.0)
        assert sorted(lost) == ["a", "b", "d"]
        assert all(f"prefill region {server.grpc_address} is unavailable" in why for why in lost.values())
        wait_until(lambda: watcher.streams == 0, 5.0)

        late = watcher.watch(server.grpc_address, on_lost("late"))  # a new stream to a dead region
        wait_until(lambda: "late" in lost, 20.0)
        late.stop()
    finally:
        watcher.close()
        server.stop(0)


def test_close_tells_no_one() -> None:
    server = RegionServer("127.0.0.1:0", {})
    server.start()
    watcher = PeerWatcher(0.2)
    lost: list[str] = []
    try:
        watcher.watch(server.grpc_address, lost.append)
        watcher.watch(server.grpc_address, lost.append)
        wait_until(lambda: watcher.answered(server.grpc_address), 20.0)
        watcher.close()
        server.stop(0)
        assert watcher.streams == 0
        threading.Event().wait(1.0)
        assert lost == []
    finally:
        server.stop(0)


def test_a_region_that_takes_the_connection_but_never_answers_is_noticed() -> None:
    """A hung region: TCP accepted, no HTTP/2 handshake. gRPC's default connect timeout would
    hold the watch 20 s; the watcher's channel gives up in max(2 s, two heartbeats)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    host, port = listener.getsockname()
    watcher = PeerWatcher(0.2)
    lost: list[str] = []
    try:
        start = time.monotonic()
        watcher.watch(f"{host}:{port}", lost.append)
        wait_until(lambda: lost, 10.0)
        assert 1.5 < time.monotonic() - start < 10.0
        assert "UNAVAILABLE" in lost[0]
    finally:
        watcher.close()
        listener.close()


def test_a_region_whose_watch_streams_are_all_taken_is_watched_again_not_lost() -> None:
    """A prefill region refuses a Watch with RESOURCE_EXHAUSTED when its Watch streams are all taken
    (region/health.py): it answered, so it is alive. Its reservations keep waiting and the watcher tries
    again a second later; before, they failed at once as if the region had died."""
    from concurrent.futures import ThreadPoolExecutor

    from grpc_health.v1 import health, health_pb2_grpc

    busy = threading.Event()
    refused: list[int] = []

    class Health(health.HealthServicer):
        def Watch(self, request, context, send_response_callback=None):  # type: ignore[no-untyped-def]
            if busy.is_set():
                refused.append(1)
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "health Watch streams: 64 are open already")
            return super().Watch(request, context, send_response_callback)

    server = grpc.server(ThreadPoolExecutor(4))
    health_pb2_grpc.add_HealthServicer_to_server(Health(experimental_non_blocking=False), server)
    target = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
    watcher = PeerWatcher(0.2)
    lost: list[str] = []
    try:
        busy.set()
        watcher.watch(target, lost.append)
        wait_until(lambda: refused or lost, 5.0)
        busy.clear()
        wait_until(lambda: watcher.answered(target) or lost, 5.0)
        assert lost == [] and watcher.answered(target)
    finally:
        watcher.close()
        server.stop(0)


def test_replies_of_a_stream_end_with_its_status() -> None:
    """`rpc.replies`: every reply of a healthy stream, the call's status as an RpcError when
    it breaks, and a cancelled call when the caller stops reading early."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from prfaas.region.channels import replies

    server = RegionServer("127.0.0.1:0", {})
    server.start()
    channel = grpc.insecure_channel(server.grpc_address)
    stub = health_pb2_grpc.HealthStub(channel)
    try:
        call = stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=30)
        stream = replies(call)
        assert next(stream).status == health_pb2.HealthCheckResponse.SERVING
        server.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        assert next(stream).status == health_pb2.HealthCheckResponse.NOT_SERVING
        stream.close()  # the caller is done: the call is cancelled
        wait_until(lambda: call.code() == grpc.StatusCode.CANCELLED, 5.0)

        broken = replies(stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=30))
        assert next(broken).status == health_pb2.HealthCheckResponse.NOT_SERVING
        server.stop(0)
        with pytest.raises(grpc.RpcError) as info:
            list(broken)  # a NOT_SERVING as the region stops, then the break
        assert info.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
    finally:
        channel.close()
        server.stop(0)


def free_port() -> int:
    """A loopback port nothing listens on (a dial is refused at once)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_a_region_no_longer_watched_leaves_no_channel_open(monkeypatch: pytest.MonkeyPatch) -> None:
    """Prefill instances come and go: each one's channel (keepalive pings every heartbeat) is closed
    when its stream ends. Before, every channel ever opened was kept until the watcher closed."""
    from prfaas.decode_region import peer_watch

    opened: list[Recorded] = []

    class Recorded:
        def __init__(self, channel: grpc.Channel) -> None:
            self.channel = channel
            self.closed = False

        def __getattr__(self, name: str) -> object:
            return getattr(self.channel, name)

        def close(self) -> None:
            self.closed = True
            self.channel.close()

    real = peer_watch.open_channel

    def recorded(*args: object) -> Recorded:
        opened.append(Recorded(real(*args)))  # type: ignore[arg-type]
        return opened[-1]

    monkeypatch.setattr(peer_watch, "open_channel", recorded)
    watcher = PeerWatcher(0.2)
    lost: list[str] = []
    try:
        for _ in range(3):
            watcher.watch(f"127.0.0.1:{free_port()}", lost.append)
        wait_until(lambda: len(lost) == 3, 10.0)
        wait_until(lambda: all(channel.closed for channel in opened), 5.0)
        assert len(opened) == 3 and watcher.streams == 0
    finally:
        watcher.close()


def test_a_watch_after_close_is_refused() -> None:
    """A Reserve racing the region's stop must not open a stream (and its channel) no one will close."""
    from prfaas.region.errors import Unavailable

    watcher = PeerWatcher(0.2)
    watcher.close()
    with pytest.raises(Unavailable):
        watcher.watch(f"127.0.0.1:{free_port()}", lambda _why: None)
    assert watcher.streams == 0
