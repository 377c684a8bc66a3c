"""A WebRTC decode region's offer listener (region/signal_client.py) against a control plane that
goes away without closing its connection, or whose Offers stream stops delivering: the listener
takes offers again within seconds (keepalive on its channel, a deadline on each Offers call).
Before, the stream had neither: after a silent loss it waited forever and no WebRTC offer was
answered again, while the region's heartbeats (same path, with keepalive) had recovered.
Registry stand-ins are real gRPC servers (link_kit.OfferDesk)."""

from __future__ import annotations

import threading

from link_kit import FreezingProxy, OfferDesk, serve_desk
from region_kit import KEY

from prfaas.decode_region.agent import DecodeAgent
from prfaas.decode_region.hf_backend import HFDecode
from prfaas.decode_region.role import build_decode
from prfaas.devstack.processes import wait_until
from prfaas.engine.hf import HFEngine
from prfaas.protos.prfaas.v1 import registry_pb2
from prfaas.region.config import config_from_mapping
from prfaas.region.signal_client import OfferListener


def _answer(offer: dict[str, str], timeout_s: float) -> dict[str, str]:
    return {"type": "answer", "sdp": "answer-to-" + offer["sdp"]}


def _offer(offer_id: str) -> registry_pb2.SignalOffer:
    return registry_pb2.SignalOffer(id=offer_id, offer_sdp=offer_id)


def _listeners() -> int:
    return sum(t.name == "prfaas-webrtc-offers" for t in threading.enumerate())


def test_offers_are_answered_again_soon_after_a_silent_loss_of_the_control_plane() -> None:
    first, replacement = OfferDesk(), OfferDesk()
    (server, address), (new_server, new_address) = serve_desk(first), serve_desk(replacement)
    proxy = FreezingProxy(address)
    listener = OfferListener(proxy.address, "dec", _answer)  # keepalive at the default 1 s interval
    listener.start()
    try:
        first.offers.put(_offer("before"))
        wait_until(lambda: first.answered("before"), 5)
        proxy.freeze()  # the control plane's host vanishes: no FIN, no RST
        server.stop(0)
        proxy.backend = new_address  # and comes back at the same address
        replacement.offers.put(_offer("after"))
        waited_s = wait_until(lambda: replacement.answered("after"), 8)  # about 2 s of keepalive, then a reconnect
        assert [a.answer_sdp for a in replacement.answers] == ["answer-to-after"], waited_s
    finally:
        listener.stop()
        proxy.close()
        new_server.stop(0)


def test_an_offers_stream_that_stops_delivering_is_replaced_at_its_deadline() -> None:
    desk = OfferDesk(stall=1)  # the first Offers call is open and never sends
    server, address = serve_desk(desk)
    listener = OfferListener(address, "dec", _answer, stream_s=1.0)
    listener.start()
    try:
        desk.offers.put(_offer("waiting"))
        wait_until(lambda: desk.answered("waiting"), 4)
        assert desk.calls >= 2
    finally:
        listener.stop()
        server.stop(0)


def test_a_webrtc_decode_role_stops_its_listener_when_it_closes(tiny_engine: HFEngine) -> None:
    """(Before, the role kept no hold of its listener: a closed role went on taking offers it could not serve.)"""
    desk = OfferDesk()
    server, address = serve_desk(desk)
    before = _listeners()
    config = config_from_mapping({
        "name": "dec-rtc", "role": "decode", "transport": "webrtc", "control_plane_url": address,
        "ticket_key": KEY.decode(), "ticket_key_id": "k1", "heartbeat_interval_s": 0.5,
        "listen": {"grpc": "127.0.0.1:0", "kv": "127.0.0.1:0"},
    })  # fmt: skip
    built = build_decode(config, tiny_engine)
    agent = built.agent
    assert isinstance(agent, DecodeAgent) and isinstance(agent.backend, HFDecode)
    try:
        assert built.kv_endpoint == "webrtc://dec-rtc"
        wait_until(lambda: desk.calls == 1 and _listeners() == before + 1, 5)
        agent.close()
        assert _listeners() == before
    finally:
        agent.close()
        agent.backend.receiver.close()
        server.stop(0)
