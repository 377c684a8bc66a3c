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


def test_an_answered_offer_whose_data_channel_never_opens_is_closed(
    receiver: WebRtcReceiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sender gone after signalling (or one that only sends offers) leaves a peer connection with its
    sockets and ICE tasks: closed once OPEN_WAIT_S passes, and closed by the receiver's close."""
    import asyncio

    import aiortc

    from prfaas.transport import webrtc_receiver
    from prfaas.transport.webrtc import rtc_configuration

    monkeypatch.setattr(webrtc_receiver, "OPEN_WAIT_S", 0.5)

    async def offer() -> dict[str, str]:
        pc = aiortc.RTCPeerConnection(configuration=rtc_configuration(()))
        pc.createDataChannel("kv")
        await pc.setLocalDescription(await pc.createOffer())
        await pc.close()  # the sender goes away before connecting
        return {"type": "offer", "sdp": pc.localDescription.sdp}

    for _ in range(3):
        receiver.answer(asyncio.run(offer()), 10.0)
    assert receiver.num_waiting == 3
    deadline = time.monotonic() + 5
    while receiver.num_waiting and time.monotonic() < deadline:
        time.sleep(0.05)
    assert receiver.num_waiting == 0


def test_a_bad_sdp_answer_fails_the_dial_as_a_connection_error() -> None:
    """What a TCP stream's thread expects of a failed connection attempt (it reconnects): a malformed
    answer from signalling is a ConnectionError, not a KeyError or aiortc's own error that ends the thread."""
    from prfaas.transport.webrtc import EventLoopThread, dial

    loop = EventLoopThread("test-dial")
    try:
        for answer in ({"type": "answer"}, {"type": "answer", "sdp": BAD_SETUP}, "nonsense"):
            with pytest.raises(ConnectionError):
                dial(loop, lambda _offer, _timeout, a=answer: a, (), 5.0)  # type: ignore[misc]
    finally:
        loop.close()
