"""A decode region's WebRTC offer listener (region/signal_client.py) against an SDP aiortc's parser asserts
on or indexes past (a real WebRtcReceiver, a real gRPC registry stand-in): that offer is answered with an
error and the listener answers the next one. Before, the listener's thread died on the first such offer and
no WebRTC shipment reached the region again while it said SERVING. Also what a data channel does
with a reader that stops reading."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest
from netns_kit import can_create, netns
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


def gone_sender_offer() -> dict[str, str]:
    """An offer whose sender went away before connecting (no ICE servers: nothing leaves the host)."""
    import asyncio

    import aiortc

    from prfaas.transport.webrtc import rtc_configuration

    async def offer() -> dict[str, str]:
        pc = aiortc.RTCPeerConnection(configuration=rtc_configuration(()))
        pc.createDataChannel("kv")
        await pc.setLocalDescription(await pc.createOffer())
        await pc.close()
        return {"type": "offer", "sdp": pc.localDescription.sdp}

    return asyncio.run(offer())


def test_an_answered_offer_whose_data_channel_never_opens_is_closed(
    receiver: WebRtcReceiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sender gone after signalling (or one that only sends offers) leaves a peer connection with its
    sockets and ICE tasks: closed once OPEN_WAIT_S passes, and closed by the receiver's close."""
    from prfaas.transport import webrtc_receiver

    monkeypatch.setattr(webrtc_receiver, "OPEN_WAIT_S", 0.5)
    for _ in range(3):
        receiver.answer(gone_sender_offer(), 10.0)
    assert receiver.num_waiting == 3
    deadline = time.monotonic() + 5
    while receiver.num_waiting and time.monotonic() < deadline:
        time.sleep(0.05)
    assert receiver.num_waiting == 0


def test_a_flood_of_offers_evicts_the_oldest_waiting_one_and_a_real_sender_still_ships() -> None:
    """Offers that never open a data channel fill `max_unverified`; the next offer evicts the oldest (as a TCP
    receiver evicts its oldest unverified connection). Refused instead, a real sender was locked out for
    OPEN_WAIT_S (30 s) by anyone who can reach signalling."""
    from transport_kit import Kit, ship

    from prfaas.transport.admission import ReceiverLimits
    from prfaas.transport.api import TransferStatus
    from prfaas.transport.tickets import TicketSigner
    from prfaas.transport.webrtc_sender import WebRtcChannel

    if not can_create():
        pytest.skip("needs root to create a network namespace (netns_kit.py: aiortc skips 127.0.0.1)")
    kit = Kit(TicketSigner({"k1": KEY}, "k1"), TicketVerifier({"k1": KEY}))
    with netns(f"prfaas-rtc-flood-{os.getpid()}"):
        receiver = WebRtcReceiver(kit.verifier, limits=ReceiverLimits(max_unverified=2))
        channel: WebRtcChannel | None = None
        try:
            for _ in range(2):
                receiver.answer(gone_sender_offer(), 10.0)
            assert receiver.num_waiting == 2
            channel = WebRtcChannel(receiver.answer, unavailable_after_s=3.0, connect_timeout_s=3.0)  # dials now
            spec = kit.spec(num_layers=2, shape=(2, 64, 64), timeout_s=10.0)
            shipped = ship(channel, receiver, spec)
            assert shipped.transfer.wait(10.0) is TransferStatus.COMPLETED, shipped.transfer.error
            assert receiver.num_waiting == 1  # one flooded offer evicted, its peer connection closed
            shipped.inbound.release()
        finally:
            if channel is not None:
                channel.close()
            receiver.close()


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


def test_a_reader_that_stops_reading_breaks_the_stream_at_the_cap_and_the_sender_sees_it(
    monkeypatch: pytest.MonkeyPatch, stream_pair: Callable[[], tuple[Any, Any]]
) -> None:
    """aiortc delivers every message as it arrives: unbounded, a stalled reader made the receiver queue the
    whole stream in memory and the sender's sends never stalled (STALL_S never fired). Past the cap the
    stream is broken: the queue is dropped, the sender's send fails (it resends on another stream) and
    the reader gets an error, not a stream that ends early as if the sender had finished."""
    from prfaas.transport import webrtc

    monkeypatch.setattr(webrtc, "RECV_QUEUE_BYTES", 1 << 20)
    if not can_create():
        pytest.skip("needs root to create a network namespace (netns_kit.py: aiortc skips 127.0.0.1)")
    with netns(f"prfaas-rtc-cap-{os.getpid()}"):  # the loop threads started inside stay in it: loopback only
        tx, rx = stream_pair()
        chunk = b"\0" * (1 << 20)
        with pytest.raises((ConnectionResetError, BrokenPipeError)):  # the channel closed under the sender
            tx.sendall(chunk * 16)  # none of it read; the first 4 MiB only fill the sender's buffer
        assert rx._queued == 0 and not rx._messages
        rx.settimeout(5.0)
        with pytest.raises(ConnectionResetError, match="fell over 1 MiB behind"):
            rx.recv_into(memoryview(bytearray(64)))


@pytest.fixture
def stream_pair() -> Iterator[Callable[[], tuple[Any, Any]]]:
    """Makes (sender's, receiver's) DataChannelStream of one peer connection with no ICE servers: host
    candidates only. Call it inside a namespace, so its loop threads and sockets stay there."""
    import aiortc

    from prfaas.transport.webrtc import DataChannelStream, EventLoopThread, dial, rtc_configuration

    made: list[Any] = []

    def make() -> tuple[Any, Any]:
        rx_loop, tx_loop = EventLoopThread("test-rx"), EventLoopThread("test-tx")
        made.extend((rx_loop, tx_loop))
        accepted: list[DataChannelStream] = []

        def signal(offer: dict[str, str], timeout_s: float) -> dict[str, str]:
            async def answer() -> dict[str, str]:
                pc = aiortc.RTCPeerConnection(configuration=rtc_configuration(()))
                pc.on("datachannel", lambda channel: accepted.append(DataChannelStream(rx_loop, pc, channel)))
                await pc.setRemoteDescription(aiortc.RTCSessionDescription(sdp=offer["sdp"], type="offer"))
                await pc.setLocalDescription(await pc.createAnswer())
                return {"type": pc.localDescription.type, "sdp": pc.localDescription.sdp}

            return rx_loop.run(answer(), timeout_s)

        tx = dial(tx_loop, signal, (), 10.0)
        made.insert(0, tx)
        deadline = time.monotonic() + 5
        while not accepted and time.monotonic() < deadline:
            time.sleep(0.01)
        made.insert(0, accepted[0])
        return tx, accepted[0]

    yield make
    for thing in made:  # streams first, then their loops
        thing.close()
