"""A decode region's WebRTC offer listener (region/signal_client.py) against an SDP aiortc's parser asserts
on or indexes past (a real WebRtcReceiver, a real gRPC registry stand-in): that offer is answered with an
error and the listener answers the next one. Before, the listener's thread died on the first such offer and
no WebRTC shipment reached the region again while it said SERVING."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest
from transport_kit import KEY

from prfaas.protos.prfaas.v1 import registry_pb2, registry_pb2_grpc
from prfaas.region.signal_client import OfferListener
from prfaas.transport.tickets import TicketVerifier
from prfaas.transport.webrtc_receiver import WebRtcReceiver

BAD_SETUP = (
    "v=0\r\no=- 1 1 IN IP4 0.0.0.0\r\ns=-\r\nt=0 0\r\nm=application 9 UDP/DTLS/SCTP webrtc-datachannel\r\n"
    "c=IN IP4 0.0.0.0\r\na=mid:0\r\na=ice-ufrag:abcd\r\na=ice-pwd:abcdefghijklmnopqrstuv\r\n"
    "a=fingerprint:sha-256 00:11\r\na=setup:bogus\r\na=sctp-port:5000\r\n"
)  # aiortc: KeyError 'bogus'


class Registry(registry_pb2_grpc.RegistryServicer):
    def __init__(self) -> None:
        self.answers: list[tuple[str, str]] = []
        self.answered = threading.Event()

    def Offers(self, request: registry_pb2.OffersRequest, context: Any) -> Iterator[registry_pb2.SignalOffer]:  # noqa: N802
        yield registry_pb2.SignalOffer(id="bad", offer_sdp=BAD_SETUP)
        yield registry_pb2.SignalOffer(id="next", offer_sdp="v=0\r\n")
        while context.is_active() and not self.answered.is_set():
            time.sleep(0.05)

    def Answer(self, request: registry_pb2.SignalAnswer, context: Any) -> registry_pb2.AnswerReply:  # noqa: N802
        self.answers.append((request.id, request.error))
        if request.id == "next":
            self.answered.set()
        return registry_pb2.AnswerReply()


@pytest.fixture
def receiver() -> Iterator[WebRtcReceiver]:
    rx = WebRtcReceiver(TicketVerifier({"k1": KEY}), node="dec", ice_servers=())
    yield rx
    rx.close()


def test_a_bad_sdp_is_a_value_error(receiver: WebRtcReceiver) -> None:
    with pytest.raises(ValueError, match="bad SDP offer"):
        receiver.answer({"type": "offer", "sdp": BAD_SETUP}, 10.0)


def test_the_listener_answers_the_offer_after_one_it_cannot_parse(receiver: WebRtcReceiver) -> None:
    registry = Registry()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    registry_pb2_grpc.add_RegistryServicer_to_server(registry, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    listener = OfferListener(f"127.0.0.1:{port}", "dec", receiver.answer)
    listener.start()
    try:
        assert registry.answered.wait(20), f"answers: {registry.answers}"
        assert [answer_id for answer_id, _ in registry.answers] == ["bad", "next"]
        assert "bad SDP offer" in registry.answers[0][1] and listener._thread.is_alive()
    finally:
        listener.stop()
        server.stop(0)
