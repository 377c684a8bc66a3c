"""One conformance suite for every transport behind the `Channel` API: in-process, shared
memory, TCP and WebRTC must reassemble bit-exactly, cancel from either side, end at the
deadline, refuse a forged ticket before storing any KV, and fail (never hang) when the
receiving peer dies mid-shipment."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import netns_kit
import pytest
from transport_kit import KEY, Kit, fill, layers_for

from prfaas.transport.api import Shipment, ShipmentSpec, TransferStatus
from prfaas.transport.errors import PeerUnavailable, TicketRejected, TransferCanceled, TransferTimeout
from prfaas.transport.tickets import TicketSigner

TRANSPORTS = ["inproc", "shm", "tcp", "webrtc"]
PEER = Path(__file__).with_name("conformance_peer.py")


@dataclass
class Pair:
    """A receiver of one kind and a way to open channels to it (closed by the fixture)."""

    kind: str
    receiver: Any
    connect: Callable[..., Any]
    channels: list[Any]

    def channel(self, **options: Any) -> Any:
        channel = self.connect(**options)
        self.channels.append(channel)
        return channel


def _connector(kind: str, receiver: Any) -> Callable[..., Any]:
    if kind == "inproc":
        from prfaas.transport.inproc import InProcessChannel

        return lambda **_: InProcessChannel(receiver)
    if kind == "shm":
        from prfaas.transport.shm_sender import ShmChannel

        return lambda **kw: ShmChannel(receiver.path, **kw)
    if kind == "tcp":
        from prfaas.transport.tcp_sender import TcpChannel

        return lambda **kw: TcpChannel(receiver.address, **{"num_streams": 2, **kw})
    from prfaas.transport.webrtc_sender import WebRtcChannel

    return lambda **kw: WebRtcChannel(lambda offer, timeout_s: receiver.answer(offer, timeout_s), **kw)


@contextlib.contextmanager
def _receiver(kind: str, kit: Kit) -> Iterator[Any]:
    if kind == "inproc":
        from prfaas.transport.inproc import InProcessReceiver

        yield InProcessReceiver(kit.verifier)
    elif kind == "shm":
        from prfaas.transport.shm_receiver import ShmReceiver

        with ShmReceiver(kit.verifier, arena_bytes=32 << 20) as shm:
            yield shm
    elif kind == "tcp":
        from prfaas.transport.tcp_receiver import TcpReceiver

        with TcpReceiver(kit.verifier) as tcp:
            yield tcp
    else:
        from prfaas.transport.webrtc_receiver import WebRtcReceiver

        with WebRtcReceiver(kit.verifier) as rtc:
            yield rtc


@contextlib.contextmanager
def _maybe_netns(kind: str) -> Iterator[None]:
    if kind != "webrtc":
        yield
        return
    if not netns_kit.can_create():
        pytest.skip("WebRTC tests need root to create a network namespace with a second loopback address")
    with netns_kit.netns(f"prfaas-conf-{os.getpid()}"):
        yield


@pytest.fixture(params=TRANSPORTS)
def pair(request: pytest.FixtureRequest, kit: Kit) -> Iterator[Pair]:
    kind = request.param
    with _maybe_netns(kind), _receiver(kind, kit) as receiver:
        result = Pair(kind, receiver, _connector(kind, receiver), [])
        try:
            yield result
        finally:
            for channel in result.channels:
                channel.close()


def _ship(pair: Pair, kit: Kit, channel: Any = None, **spec_kw: Any) -> tuple[Any, Any, ShipmentSpec, Shipment]:
    spec = kit.spec(**spec_kw)
    inbound = pair.receiver.expect(spec.job_id, spec.attempt, timeout_s=spec.timeout_s)
    shipment = Shipment(spec)
    transfer = (channel or pair.channel()).submit(shipment)
    return transfer, inbound, spec, shipment


def _until(predicate: Callable[[], bool], timeout_s: float) -> bool:
    end = time.monotonic() + timeout_s
    while not predicate() and time.monotonic() < end:
        time.sleep(0.01)
    return predicate()


@pytest.mark.parametrize("codec", ["raw", "lossless"])
def test_shipment_reassembles_bit_exactly(pair: Pair, kit: Kit, codec: str) -> None:
    transfer, inbound, spec, shipment = _ship(pair, kit, codec=codec, num_layers=4, shape=(2, 300, 64))
    layers = layers_for(spec, seed=7)
    fill(shipment, layers)
    assert transfer.wait(20) is TransferStatus.COMPLETED, transfer.error
    assert inbound.wait(5) is TransferStatus.COMPLETED
    for index, (k, v) in enumerate(layers):
        got_k, got_v = inbound.layer(index, timeout_s=1)
        assert bytes(got_k) == k and bytes(got_v) == v
    assert transfer.stats.raw_bytes == spec.raw_bytes
    inbound.release()


def test_concurrent_shipments_on_one_channel_all_arrive_intact(pair: Pair, kit: Kit) -> None:
    channel = pair.channel()
    shipped = []
    for seed in range(4):
        transfer, inbound, spec, shipment = _ship(pair, kit, channel, num_layers=3, shape=(2, 256, 64))
        layers = layers_for(spec, seed=seed)
        fill(shipment, layers)
        shipped.append((transfer, inbound, layers))
    for transfer, inbound, layers in shipped:
        assert transfer.wait(20) is TransferStatus.COMPLETED, transfer.error
        assert [tuple(map(bytes, inbound.layer(i, 1))) for i in range(3)] == layers


def test_each_layer_is_exposed_as_soon_as_it_arrives(pair: Pair, kit: Kit) -> None:
    transfer, inbound, spec, shipment = _ship(pair, kit, num_layers=3)
    layers = layers_for(spec)
    shipment.add_layer(0, *layers[0])
    k, v = inbound.layer(0, timeout_s=10)  # before layers 1 and 2 exist
    assert (bytes(k), bytes(v)) == layers[0]
    assert transfer.status() is TransferStatus.IN_FLIGHT
    transfer.cancel()


def test_sender_cancel_frees_the_receiver(pair: Pair, kit: Kit) -> None:
    transfer, inbound, spec, shipment = _ship(pair, kit, num_layers=3)
    shipment.add_layer(0, *layers_for(spec)[0])
    assert _until(lambda: inbound.info is not None, 10)  # the OPEN got there
    transfer.cancel()
    assert transfer.status() is TransferStatus.CANCELED
    assert inbound.wait(5) is TransferStatus.CANCELED
    assert isinstance(inbound.error, TransferCanceled)
    with pytest.raises(TransferCanceled):
        inbound.layer(1, timeout_s=0.1)


def test_receiver_cancel_reaches_the_sender(pair: Pair, kit: Kit) -> None:
    transfer, inbound, spec, shipment = _ship(pair, kit, num_layers=3)
    shipment.add_layer(0, *layers_for(spec)[0])
    assert _until(lambda: inbound.info is not None, 10)
    inbound.cancel("client went away")
    assert transfer.wait(5) is TransferStatus.CANCELED
    assert isinstance(transfer.error, TransferCanceled)


def test_an_incomplete_shipment_ends_at_its_deadline(pair: Pair, kit: Kit) -> None:
    transfer, inbound, spec, shipment = _ship(pair, kit, num_layers=3, timeout_s=1.0)
    shipment.add_layer(0, *layers_for(spec)[0])  # layers 1 and 2 never come
    start = time.monotonic()
    assert transfer.wait(10) is TransferStatus.TIMEOUT
    assert isinstance(transfer.error, TransferTimeout)
    assert time.monotonic() - start < 2.0
    # the receiver ends too: at its own deadline, or on the CANCEL the timed-out sender sends first
    assert inbound.wait(5) in (TransferStatus.TIMEOUT, TransferStatus.CANCELED)


def test_forged_ticket_is_refused_before_any_kv_is_stored(pair: Pair, kit: Kit) -> None:
    base = kit.spec()
    forged = TicketSigner({"k1": b"f" * 32}, "k1").issue(base.job_id, 1, "acme", base.raw_bytes, 60)
    transfer, inbound, spec, shipment = _ship(pair, kit, job_id=base.job_id, ticket=forged)
    fill(shipment, layers_for(spec))
    assert transfer.wait(10) is TransferStatus.FAILED
    assert isinstance(transfer.error, TicketRejected)
    assert inbound.info is None
    assert inbound.wire_bytes == 0


@pytest.mark.parametrize(
    ("tenant", "max_bytes", "message"),
    [("globex", None, "ticket is for tenant 'acme'"), ("acme", 1000, "exceeds the reservation's budget")],
)
def test_a_ticket_for_another_tenant_or_past_the_reservation_is_refused_at_open(
    pair: Pair, kit: Kit, tenant: str, max_bytes: int | None, message: str
) -> None:
    """The reservation's tenant and size are checked at OPEN, before any KV is stored: the
    transfer fails with TicketRejected and the inbound ends with the same error."""
    spec = kit.spec(num_layers=2)  # its ticket is for tenant "acme"
    inbound = pair.receiver.expect(spec.job_id, spec.attempt, spec.timeout_s, tenant=tenant, max_bytes=max_bytes)
    shipment = Shipment(spec)
    transfer = pair.channel().submit(shipment)
    fill(shipment, layers_for(spec))
    assert transfer.wait(10) is TransferStatus.FAILED
    assert isinstance(transfer.error, TicketRejected) and message in str(transfer.error)
    assert inbound.wait(5) is TransferStatus.FAILED
    assert isinstance(inbound.error, TicketRejected) and message in str(inbound.error)
    assert inbound.wire_bytes == 0


def test_shipment_without_reservation_is_refused(pair: Pair, kit: Kit) -> None:
    transfer = pair.channel().submit(Shipment(kit.spec()))
    assert transfer.wait(10) is TransferStatus.FAILED
    assert "no reservation" in str(transfer.error)


def test_receiver_going_away_mid_shipment_fails_the_transfer_in_time(pair: Pair, kit: Kit) -> None:
    """Peer death. Across processes (shm, tcp, webrtc) the receiver is SIGKILLed mid-shipment;
    the in-process receiver has no process of its own, so it shuts down instead."""
    spec = kit.spec(num_layers=8, shape=(4, 1024, 64), timeout_s=4.0)
    layers = layers_for(spec)
    before = threading.active_count()
    peer: subprocess.Popen[str] | None = None
    try:
        if pair.kind == "inproc":
            pair.receiver.expect(spec.job_id, spec.attempt, timeout_s=30)
            channel = pair.channel()
        else:
            peer, channel = _peer_channel(pair, spec)
        shipment = Shipment(spec)
        transfer = channel.submit(shipment)
        shipment.add_layer(0, *layers[0])
        assert _until(lambda: transfer.stats.wire_bytes > 0 or transfer.status().terminal, 10)
        if peer is not None:
            peer.kill()  # kill -9: no goodbye
        else:
            pair.receiver.core.cancel_all("receiver shutting down")
        start = time.monotonic()
        with contextlib.suppress(ValueError):  # a transfer that already ended
            for index in range(1, 8):
                shipment.add_layer(index, *layers[index])
        status = transfer.wait(10)
        assert status in (TransferStatus.FAILED, TransferStatus.TIMEOUT, TransferStatus.CANCELED), status
        assert isinstance(transfer.error, PeerUnavailable | TransferTimeout | TransferCanceled)
        assert time.monotonic() - start < 5.0
        if channel in pair.channels:
            pair.channels.remove(channel)
        channel.close()
        assert _until(lambda: threading.active_count() <= before, 5), [t.name for t in threading.enumerate()]
    finally:
        if peer is not None:
            peer.kill()
            peer.wait(5)


def _peer_channel(pair: Pair, spec: ShipmentSpec) -> tuple[subprocess.Popen[str], Any]:
    command = [sys.executable, str(PEER), pair.kind, KEY.hex(), spec.job_id]
    if pair.kind == "webrtc":  # the peer joins the namespace this thread is in
        command = ["ip", "netns", "exec", f"prfaas-conf-{os.getpid()}", *command]
    peer = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert peer.stdout is not None and peer.stdin is not None
    endpoint = json.loads(peer.stdout.readline())
    if pair.kind == "tcp":
        from prfaas.transport.tcp_sender import TcpChannel

        return peer, TcpChannel(
            ("127.0.0.1", endpoint["port"]), num_streams=2, unavailable_after_s=1.0, connect_timeout_s=0.5
        )
    if pair.kind == "shm":
        from prfaas.transport.shm_sender import ShmChannel

        return peer, ShmChannel(endpoint["path"])
    from prfaas.transport.webrtc_sender import WebRtcChannel

    lock = threading.Lock()

    def signal(offer: dict[str, str], _timeout_s: float) -> dict[str, str]:
        assert peer.stdin is not None and peer.stdout is not None
        with lock:
            peer.stdin.write(json.dumps(offer) + "\n")
            peer.stdin.flush()
            answer: dict[str, str] = json.loads(peer.stdout.readline())
            return answer

    return peer, WebRtcChannel(signal, unavailable_after_s=1.0, connect_timeout_s=2.0)
