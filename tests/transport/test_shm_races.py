"""The shared-memory sender's races and hostile replies: a link's break fails only the transfers opened
on it, a submit racing `close` leaves nothing behind, a reply whose checksum fails is never acted on, and
the CANCELs `close` causes reach the receiver. Each race window is held open by the test (events, the
writer's lock), so each outcome is deterministic."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable

import pytest
from transport_kit import Kit, fill, layers_for, ship

from prfaas.transport.api import Shipment, TransferStatus
from prfaas.transport.errors import PeerUnavailable
from prfaas.transport.framing import HEADER_SIZE, Frame, FrameType, Header, parse_header
from prfaas.transport.outbound import OutboundTransfer
from prfaas.transport.shm_receiver import ShmConnection, ShmReceiver
from prfaas.transport.shm_sender import ShmChannel, _Link


def until(condition: Callable[[], bool], timeout_s: float = 3.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.005)
    return condition()


def test_a_break_of_the_old_link_fails_no_transfer_a_concurrent_submit_opened_on_a_new_one(kit: Kit) -> None:
    """`_broken` closes the link, then fails its transfers; a submit in between dials a new link and opens
    its transfer there: that one is not the broken link's to fail."""
    with ShmReceiver(kit.verifier, arena_bytes=8 << 20) as rx, ShmChannel(rx.path) as channel:
        first = kit.spec(num_layers=1, shape=(1, 16, 64), timeout_s=30)
        rx.expect(first.job_id, 1, 30)
        old = channel.submit(Shipment(first))
        link = channel._link
        assert link is not None
        closed, resume = threading.Event(), threading.Event()
        close = link.close

        def close_then_hold() -> None:  # the window between the link's close and the failing of its transfers
            close()
            if threading.current_thread().name == "breaker":
                closed.set()
                resume.wait(5)

        link.close = close_then_hold  # type: ignore[method-assign]
        breaker = threading.Thread(target=channel._broken, args=(link, "control socket broken"), name="breaker")
        breaker.start()
        assert closed.wait(5)
        second = kit.spec(num_layers=1, shape=(1, 16, 64), timeout_s=30)
        transfer, inbound, layers, _ = ship(channel, rx, second, expect_timeout_s=30)
        assert channel._link is not link  # the submit dialled a new link
        resume.set()
        breaker.join(5)
        assert old.status() is TransferStatus.FAILED
        assert transfer.wait(10) is TransferStatus.COMPLETED, transfer.error
        assert [tuple(map(bytes, inbound.layer(0, 1)))] == layers


def test_a_submit_racing_close_dials_no_link_after_it(kit: Kit) -> None:
    """A submit that got into the table before `close` and dials only after it: it must not connect (a
    control socket, a reader thread and the arena's mapping nobody would close), and the transfer ends."""
    with ShmReceiver(kit.verifier, arena_bytes=8 << 20) as rx:
        channel = ShmChannel(rx.path)
        spec = kit.spec(num_layers=1, shape=(1, 16, 64), timeout_s=30)
        rx.expect(spec.job_id, 1, 30)
        dialling, closed = threading.Event(), threading.Event()
        connected = channel._connected

        def connect_after_close() -> _Link:
            dialling.set()
            closed.wait(5)
            return connected()

        channel._connected = connect_after_close  # type: ignore[method-assign]
        submitted: list[OutboundTransfer] = []
        submitter = threading.Thread(target=lambda: submitted.append(channel.submit(Shipment(spec))))
        submitter.start()
        assert dialling.wait(5)
        channel.close()
        closed.set()
        submitter.join(5)
        assert channel._link is None
        assert until(lambda: rx.num_connections == 0, 1.0), "a link dialled after close is still connected"
        (transfer,) = submitted
        assert transfer.status().terminal
        assert not [t for t in threading.enumerate() if t.name == "prfaas-shm-reader"]


def test_a_reply_that_fails_its_checksum_breaks_the_link_instead_of_being_applied(
    kit: Kit, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One bit of the receiver's first ACK flips on its way: the sender must not acknowledge whatever chunk
    it now names. It cannot trust anything after it on that socket either: the link is broken, and its
    transfer fails with PeerUnavailable naming the checksum."""
    write = ShmConnection.write
    corrupted = threading.Event()

    def corrupting(self: ShmConnection, data: bytes) -> None:
        out, offset = bytearray(data), 0
        while offset < len(out) and not corrupted.is_set():
            header = parse_header(out[offset : offset + HEADER_SIZE])
            if header.type is FrameType.ACK:
                out[offset + HEADER_SIZE + 4] ^= 0x01  # the first entry's part: the other part's chunk
                corrupted.set()
            offset += HEADER_SIZE + header.payload_len
        write(self, bytes(out))

    monkeypatch.setattr(ShmConnection, "write", corrupting)
    with ShmReceiver(kit.verifier, arena_bytes=8 << 20) as rx, ShmChannel(rx.path) as channel:
        spec = kit.spec(num_layers=2, shape=(1, 64, 64), chunk_bytes=4096, timeout_s=30)  # 2 chunks a part
        layers = layers_for(spec)
        transfer, _inbound, _layers, shipment = ship(channel, rx, spec, num_filled=1, expect_timeout_s=30)
        assert corrupted.wait(5)  # layer 0's ACK (the DONE, later, would complete it whatever came before)
        shipment.add_layer(1, *layers[1])
        assert transfer.wait(10) is TransferStatus.FAILED
        assert isinstance(transfer.error, PeerUnavailable) and "checksum" in str(transfer.error), transfer.error


def test_the_cancels_close_causes_reach_the_receiver_while_a_write_is_in_progress(kit: Kit) -> None:
    """`close` cancels live transfers while a copy thread is writing (the test holds the writer's lock): each
    CANCEL is queued behind that write, and must go out before the socket closes, or the receiver keeps the
    shipment (and its arena room) until its deadline."""
    with ShmReceiver(kit.verifier, arena_bytes=8 << 20) as rx:
        channel = ShmChannel(rx.path)
        spec = kit.spec(num_layers=2, shape=(1, 16, 64), timeout_s=30)
        inbound = rx.expect(spec.job_id, 1, 30)
        shipment = Shipment(spec)
        transfer = channel.submit(shipment)
        fill(shipment, layers_for(spec)[:1])  # one layer of two: the shipment stays open
        assert until(lambda: transfer.accepted), transfer.error
        inbound.layer(0, 5)  # its chunks are in: nothing but the CANCEL is left to write
        link = channel._link
        assert link is not None
        link.writer.lock.acquire()  # a copy thread's write in progress
        try:
            closer = threading.Thread(target=channel.close)
            closer.start()
            assert until(lambda: link.writer.queued == 1)  # the CANCEL, posted behind the write
            until(lambda: not link.alive, 0.3)  # (before the fix: the socket closes here, the CANCEL with it)
        finally:
            link.writer.lock.release()  # the write is done
        closer.join(5)
        assert transfer.status() is TransferStatus.CANCELED
        assert inbound.wait(2) is TransferStatus.CANCELED, inbound.error


def test_a_cancel_while_the_open_is_going_out_reaches_the_receiver_after_the_open(kit: Kit) -> None:
    """The transfer is canceled after `submit` marked it opened on the link and before its OPEN went out (the
    test holds that window): its CANCEL must follow the OPEN, or the receiver opens a shipment nobody cancels
    and keeps it (and its arena room) until its deadline."""
    with ShmReceiver(kit.verifier, arena_bytes=8 << 20) as rx, ShmChannel(rx.path) as channel:
        warm = kit.spec(num_layers=1, shape=(1, 16, 64), timeout_s=30)  # the link is up: the next OPEN is all
        assert ship(channel, rx, warm, expect_timeout_s=30)[0].wait(10) is TransferStatus.COMPLETED
        link = channel._link
        assert link is not None
        opening, resume = threading.Event(), threading.Event()
        send = link.send

        def hold_the_open(header: bytes, payload: bytes | memoryview = b"") -> None:
            if parse_header(header[:HEADER_SIZE]).type is FrameType.OPEN:
                opening.set()
                resume.wait(5)
            send(header, payload)

        link.send = hold_the_open  # type: ignore[method-assign]
        spec = kit.spec(num_layers=2, shape=(1, 16, 64), timeout_s=30)
        inbound = rx.expect(spec.job_id, 1, 30)
        submitted: list[OutboundTransfer] = []
        submitter = threading.Thread(target=lambda: submitted.append(channel.submit(Shipment(spec))))
        submitter.start()
        assert opening.wait(5)
        (transfer,) = channel.table.live()
        transfer.cancel()  # the decode engine gives up on it, its OPEN not out yet
        resume.set()
        submitter.join(5)
        assert submitted == [transfer] and transfer.status() is TransferStatus.CANCELED
        assert inbound.wait(2) is TransferStatus.CANCELED, inbound.status()


def test_close_gives_up_on_a_receiver_that_stopped_reading_within_its_drain_budget(
    kit: Kit, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A receiver that stops reading its control socket while `close` cancels 100 shipments whose CANCELs
    queued behind a write in progress (the test holds the writer's lock): the socket has room for a few, not
    all. The drain must give up at its 1 s budget, not wait the send timeout out on a receiver nobody serves."""
    stuck, release = threading.Event(), threading.Event()
    frame = ShmConnection._frame

    def stalling(self: ShmConnection, header: Header) -> list[Frame]:
        if stuck.is_set():
            release.wait(30)  # the receiver takes no more control bytes
        return frame(self, header)

    monkeypatch.setattr(ShmConnection, "_frame", stalling)
    with ShmReceiver(kit.verifier, arena_bytes=32 << 20) as rx:
        channel = ShmChannel(rx.path, send_timeout_s=5.0)
        transfers = []
        for _ in range(100):
            spec = kit.spec(num_layers=1, shape=(1, 16, 64), timeout_s=30)
            rx.expect(spec.job_id, 1, 30)
            transfers.append(channel.submit(Shipment(spec)))
        assert until(lambda: all(t.accepted for t in transfers)), [t.error for t in transfers if t.error]
        link = channel._link
        assert link is not None
        link.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)  # room for a few CANCELs, not 100
        stuck.set()
        link.writer.lock.acquire()  # a copy thread's write in progress
        try:
            began = time.monotonic()
            closer = threading.Thread(target=channel.close)
            closer.start()
            assert until(lambda: link.writer.queued == len(transfers))
        finally:
            link.writer.lock.release()
        closer.join(15)
        took_s = time.monotonic() - began
        release.set()
        assert took_s < 1.0 + 0.5, f"close took {took_s:.1f} s"  # (before the fix: the send timeout, 5 s, and more)
        assert all(t.status() is TransferStatus.CANCELED for t in transfers)
