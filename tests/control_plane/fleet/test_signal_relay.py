"""WebRTC offers through the registry (fleet/signaling.py, fleet/server.py; a real gRPC registry on the real
Redis) are not lost when a region's Offers stream ends: the registry's handler of a stream that has just ended
still waits in Redis for up to a second, and an offer it takes then goes back to the head of the region's queue
for its next stream. Before, it was sent into the ended stream and lost: its sender waited its whole timeout
and failed, though the region's next stream opened at once. Nor does a call take an offer just before its
deadline: the call ends OK and the region opens the next."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
import redis
from cp_kit import settings_fixture

from prfaas.control_plane.fleet.registry import RegionRegistry
from prfaas.control_plane.fleet.server import serve_registry
from prfaas.protos.prfaas.v1 import registry_pb2, registry_pb2_grpc


@pytest.fixture
def stub() -> Iterator[registry_pb2_grpc.RegistryStub]:
    for settings in settings_fixture():
        client = redis.Redis.from_url(settings.redis_url)
        server, address = serve_registry(RegionRegistry(client, settings), "127.0.0.1:0")
        with grpc.insecure_channel(address) as channel:
            yield registry_pb2_grpc.RegistryStub(channel)
        server.stop(0)
        client.close()


def _signal(stub: registry_pb2_grpc.RegistryStub, sdp: str) -> grpc.Future:
    return stub.Signal.future(registry_pb2.SignalRequest(region="rtc", offer_sdp=sdp, timeout_s=4), timeout=8)


def _answer(stub: registry_pb2_grpc.RegistryStub, offer: registry_pb2.SignalOffer) -> None:
    stub.Answer(registry_pb2.SignalAnswer(id=offer.id, answer_sdp="answer-to-" + offer.offer_sdp), timeout=5)


def test_an_offer_taken_for_a_stream_that_just_ended_goes_to_the_regions_next_stream(
    stub: registry_pb2_grpc.RegistryStub,
) -> None:
    first = stub.Offers(registry_pb2.OffersRequest(region="rtc"), timeout=10)
    warm = _signal(stub, "warm")
    _answer(stub, next(first))
    assert warm.result().answer_sdp == "answer-to-warm"  # the handler of `first` waits in Redis again by now
    first.cancel()  # the region's stream ends (its connection broke, or it reopens the stream)
    late = _signal(stub, "late")  # taken by `first`'s handler, still waiting for up to 1 s
    second = stub.Offers(registry_pb2.OffersRequest(region="rtc"), timeout=3)
    offer = next(second)  # before: DEADLINE_EXCEEDED, the offer gone with `first`
    assert offer.offer_sdp == "late"
    _answer(stub, offer)
    assert late.result().answer_sdp == "answer-to-late"
    second.cancel()


def test_an_offers_call_ends_before_its_deadline_and_leaves_the_offers_queued(
    stub: registry_pb2_grpc.RegistryStub,
) -> None:
    short = stub.Offers(registry_pb2.OffersRequest(region="rtc"), timeout=1.0)
    assert list(short) == []  # it ended OK, in time for the region to see its end, with nothing taken
    sent = _signal(stub, "queued")
    offer = next(stub.Offers(registry_pb2.OffersRequest(region="rtc"), timeout=3))
    assert offer.offer_sdp == "queued"
    _answer(stub, offer)
    assert sent.result().answer_sdp == "answer-to-queued"
