"""The registry's WebRTC signalling under load and bad input (a real gRPC registry on the real Redis): calls
that wait (a region's Offers stream, a sender's Signal) never take the threads Register and Heartbeat need
(before, 8 webrtc regions' Offers streams took the registry's whole pool and the fleet's heartbeats stopped);
past MAX_SIGNAL_CALLS, or MAX_PENDING_OFFERS for one region, they are RESOURCE_EXHAUSTED; an offer or answer
that is not one is INVALID_ARGUMENT. One caller's Signals are bounded on their own."""

from __future__ import annotations

import time
from collections.abc import Iterator

import grpc
import pytest
import redis
from cp_kit import settings_fixture

from prfaas.control_plane.fleet import server as registry_server
from prfaas.control_plane.fleet.registry import RegionRegistry
from prfaas.control_plane.fleet.server import serve_registry
from prfaas.control_plane.fleet.signaling import MAX_PENDING_OFFERS, MAX_SDP_BYTES
from prfaas.protos.prfaas.v1 import registry_pb2, registry_pb2_grpc


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[RegionRegistry, registry_pb2_grpc.RegistryStub]]:
    monkeypatch.setattr(registry_server, "MAX_SIGNAL_CALLS", 12)
    monkeypatch.setattr(registry_server, "THREADS", 16 + 12)
    for settings in settings_fixture():
        client = redis.Redis.from_url(settings.redis_url)
        reg = RegionRegistry(client, settings)
        server, address = serve_registry(reg, "127.0.0.1:0")
        channel = grpc.insecure_channel(address)
        yield reg, registry_pb2_grpc.RegistryStub(channel)
        channel.close()
        server.stop(0)
        client.close()


def _registration(name: str) -> registry_pb2.RegisterRequest:
    return registry_pb2.RegisterRequest(name=name, role="decode", num_workers=1, grpc_endpoint="127.0.0.1:1",
                                        kv_endpoint=f"webrtc://{name}", heartbeat_interval_s=1.0)  # fmt: skip


def test_offers_streams_leave_threads_for_the_fleets_heartbeats(
    registry: tuple[RegionRegistry, registry_pb2_grpc.RegistryStub],
) -> None:
    _reg, stub = registry
    streams = [stub.Offers(registry_pb2.OffersRequest(region=f"rtc-{i}")) for i in range(12)]
    try:
        time.sleep(1.0)  # each one open and waiting in the registry
        token = stub.Register(_registration("dec"), timeout=3).region_id  # 12 waiting: the registry answers
        assert not stub.Heartbeat(registry_pb2.HeartbeatRequest(name="dec", region_id=token), timeout=3).reregister
        for call in (  # a 13th waiting call
            lambda: next(stub.Offers(registry_pb2.OffersRequest(region="rtc-12"), timeout=3)),
            lambda: stub.Signal(registry_pb2.SignalRequest(region="rtc-0", offer_sdp="v=0", timeout_s=1), timeout=3),
        ):
            with pytest.raises(grpc.RpcError) as info:
                call()
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        for stream in streams:
            stream.cancel()


@pytest.mark.parametrize(
    "request_",
    [
        registry_pb2.SignalRequest(region="a/b", offer_sdp="v=0", timeout_s=1),
        registry_pb2.SignalRequest(region="rtc", offer_sdp="v" * (MAX_SDP_BYTES + 1), timeout_s=1),
        registry_pb2.SignalRequest(region="rtc", offer_sdp="v=0", timeout_s=float("nan")),
        registry_pb2.SignalRequest(region="rtc", offer_sdp="v=0", timeout_s=float("inf")),
    ],
)
def test_an_offer_that_is_not_one_is_invalid(
    registry: tuple[RegionRegistry, registry_pb2_grpc.RegistryStub], request_: registry_pb2.SignalRequest
) -> None:
    _reg, stub = registry
    with pytest.raises(grpc.RpcError) as info:
        stub.Signal(request_, timeout=5)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_offers_past_the_regions_queue_and_odd_answers_are_refused(
    registry: tuple[RegionRegistry, registry_pb2_grpc.RegistryStub],
) -> None:
    reg, stub = registry
    queue = reg.settings.key("signal:rtc")
    reg.redis.rpush(queue, *(['{"id": "x", "sdp": "v=0", "exp": 0}'] * MAX_PENDING_OFFERS))
    with pytest.raises(grpc.RpcError) as info:
        stub.Signal(registry_pb2.SignalRequest(region="rtc", offer_sdp="v=0", timeout_s=1), timeout=5)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    for answer in (registry_pb2.SignalAnswer(id="../x", answer_sdp="v=0"),
                   registry_pb2.SignalAnswer(id="a" * 32, answer_sdp="v" * (MAX_SDP_BYTES + 1))):  # fmt: skip
        with pytest.raises(grpc.RpcError) as info:
            stub.Answer(answer, timeout=5)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    stub.Answer(registry_pb2.SignalAnswer(id="a" * 32, answer_sdp="v=0"), timeout=5)


def test_one_caller_cannot_take_every_signalling_slot(
    registry: tuple[RegionRegistry, registry_pb2_grpc.RegistryStub],
) -> None:
    """A caller's waiting Signal calls stop at MAX_SIGNALS_PER_CALLER (RESOURCE_EXHAUSTED), and a region's
    Offers stream still finds a slot (before, one region's 64 Signals blocked every region's signalling)."""
    _reg, stub = registry
    offer = registry_pb2.SignalRequest(region="rtc-0", offer_sdp="v=0", timeout_s=3)
    waiting = [stub.Signal.future(offer, timeout=10) for _ in range(registry_server.MAX_SIGNALS_PER_CALLER)]
    time.sleep(0.5)  # each one waiting for an answer
    with pytest.raises(grpc.RpcError) as info:
        stub.Signal(offer, timeout=5)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "127.0.0.1" in (info.value.details() or "")
    stream = stub.Offers(registry_pb2.OffersRequest(region="rtc-0"), timeout=5)
    assert next(stream).offer_sdp == "v=0"  # the region reads the offers waiting for it
    stream.cancel()
    for call in waiting:
        call.cancel()
