"""Multi-stream TCP on loopback: real sockets, real threads, faults injected on the wire."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from transport_kit import KEY, Kit, fill, layers_for, ship, wait_until_sent

from prfaas.transport import receiver_base, sockets
from prfaas.transport.api import Shipment, TransferStatus
from prfaas.transport.errors import PeerUnavailable, TicketRejected, TransferTimeout
from prfaas.transport.framing import (
    HEADER_SIZE,
    Frame,
    FrameType,
    ack_payload,
    encode,
    json_payload,
    parse_header,
    read_exact,
    read_frame,
)
from prfaas.transport.open_info import OpenInfo
from prfaas.transport.outbound import encoder_pool
from prfaas.transport.tcp_receiver import TcpReceiver
from prfaas.transport.tcp_sender import TcpChannel
from prfaas.transport.tcp_stream import TcpStream
from prfaas.transport.tickets import TicketSigner

PEER = Path(__file__).with_name("conformance_peer.py")


@pytest.fixture
def receiver(kit: Kit) -> Iterator[TcpReceiver]:
    with TcpReceiver(kit.verifier) as rx:
        yield rx


@pytest.mark.parametrize("codec", ["raw", "lossless"])
def test_shipment_over_four_streams_reassembles_bit_exactly(kit: Kit, receiver: TcpReceiver, codec: str) -> None:
    with TcpChannel(receiver.address, num_streams=4) as channel:
        transfer, inbound, layers, _ = ship(channel, receiver, kit.spec(codec=codec))
        assert transfer.wait(15) is TransferStatus.COMPLETED, transfer.error
        assert inbound.wait(5) is TransferStatus.COMPLETED
        for index, pair in enumerate(layers):
            assert inbound.layer(index, 1) == pair
        assert transfer.stats.raw_bytes == transfer.spec.raw_bytes
        # no connection broke (the small shipment may finish before the last one's handshake)
        deadline = time.monotonic() + 5
        while channel.num_connected < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert channel.num_connected == 4
        assert channel.queue.inflight_bytes == 0


def test_concurrent_jobs_share_the_pool(kit: Kit, receiver: TcpReceiver) -> None:
    with TcpChannel(receiver.address, num_streams=3) as channel:
        shipped = [ship(channel, receiver, kit.spec(num_layers=3)) for _ in range(5)]
        for transfer, inbound, layers, _ in shipped:
            assert transfer.wait(15) is TransferStatus.COMPLETED, transfer.error
            assert inbound.layer(2, 1) == layers[2]
        assert receiver.num_connections == 3  # no connection per job


def test_killing_a_stream_mid_shipment_still_completes(kit: Kit, receiver: TcpReceiver) -> None:
    with TcpChannel(receiver.address, num_streams=4, max_inflight_bytes=256 << 10) as channel:
        spec = kit.spec(num_layers=8, shape=(4, 1024, 64))
        transfer, inbound, layers, shipment = ship(channel, receiver, spec, num_filled=4)
        deadline = time.monotonic() + 5
        while transfer.stats.wire_bytes < 512 << 10 and time.monotonic() < deadline:
            time.sleep(0.001)
        channel.streams[1].kill()
        channel.streams[2].kill()
        for index in range(4, 8):
            shipment.add_layer(index, *layers[index])
        assert transfer.wait(15) is TransferStatus.COMPLETED, transfer.error
        assert [inbound.layer(i, 1) for i in range(8)] == layers


def test_a_copy_resent_on_a_new_connection_takes_over_from_one_gone_silent_mid_chunk(
    kit: Kit, receiver: TcpReceiver
) -> None:
    """A cut link leaves the receiver's connection reading a chunk that will never finish: no RST
    reaches it, and keepalive would notice in a minute. The copy the sender resends on its new
    connection is stored at once and the stale connection closed (dropping its claim). Before,
    the copy was NACKed (PENDING) after waiting 1 s, and again on every resend, until keepalive."""
    spec = kit.spec(num_layers=1, shape=(1, 256, 64))  # each part 32 KiB: one chunk
    inbound = receiver.expect(spec.job_id, spec.attempt, timeout_s=20)
    job = uuid.UUID(spec.job_id).bytes
    hello = encode(Frame(FrameType.HELLO, payload=json_payload({"versions": [1], "node": "prefill"})))
    info = OpenInfo(spec.dtype, spec.layer_shapes, 0, spec.chunk_bytes)
    opening = encode(Frame(FrameType.OPEN, job, 1, payload=json_payload(info.to_json(spec.ticket))))
    k, _v = layers_for(spec)[0]
    data = encode(Frame(FrameType.DATA, job, 1, 0, 0, 0, 0, 1, len(k), k))
    with socket.create_connection(receiver.address, 5) as stale, socket.create_connection(receiver.address, 5) as new:
        stale.sendall(hello + opening)
        assert [read_frame(stale)[0].type for _ in range(2)] == [FrameType.HELLO_OK, FrameType.OPEN_OK]
        stale.sendall(data[: len(data) // 2])  # then silence: the link was cut mid-chunk
        time.sleep(0.2)
        start = time.monotonic()
        new.sendall(hello + opening + data)
        replies = [read_frame(new)[0].type for _ in range(3)]
        assert replies == [FrameType.HELLO_OK, FrameType.OPEN_OK, FrameType.ACK]
        assert time.monotonic() - start < 0.5
        with contextlib.suppress(ConnectionResetError):
            assert stale.recv(1) == b""  # the receiver closed the stale connection
        assert inbound.status() is TransferStatus.IN_FLIGHT  # V is still to come; K is stored


class CorruptingProxy:
    """Forwards a TCP connection and flips one payload byte in the first DATA frame."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = self.listener.getsockname()[:2]
        self.flipped = 0
        self.threads: list[threading.Thread] = []
        self.sockets: list[socket.socket] = []
        self._spawn(self._accept)

    def _spawn(self, fn: object, *args: object) -> None:
        thread = threading.Thread(target=fn, args=args, daemon=True)  # type: ignore[arg-type]
        self.threads.append(thread)
        thread.start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            self.sockets += [client, upstream]
            self._spawn(self._frames, client, upstream)
            self._spawn(self._bytes, upstream, client)

    def _frames(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                head = read_exact(src, HEADER_SIZE)
                header = parse_header(bytes(head))
                payload = read_exact(src, header.payload_len)
                if header.type is FrameType.DATA and self.flipped == 0 and payload:
                    payload[len(payload) // 2] ^= 0xFF
                    self.flipped += 1
                dst.sendall(bytes(head) + bytes(payload))
        except (OSError, ConnectionError):
            pass

    def _bytes(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass

    def close(self) -> None:
        self.listener.close()
        for sock in self.sockets:
            sock.close()


def test_flipped_byte_is_detected_and_resent(kit: Kit, receiver: TcpReceiver) -> None:
    proxy = CorruptingProxy(receiver.address)
    try:
        with TcpChannel(proxy.address, num_streams=1) as channel:
            transfer, inbound, layers, _ = ship(channel, receiver, kit.spec(num_layers=3))
            assert transfer.wait(10) is TransferStatus.COMPLETED
            assert proxy.flipped == 1
            assert transfer.stats.resent_chunks >= 1
            assert [inbound.layer(i, 1) for i in range(3)] == layers
    finally:
        proxy.close()


def test_forged_ticket_is_refused_before_any_kv_is_stored(kit: Kit, receiver: TcpReceiver) -> None:
    base = kit.spec()
    forged = TicketSigner({"k1": b"f" * 32}, "k1").issue(base.job_id, 1, "acme", base.raw_bytes, 60)
    with TcpChannel(receiver.address, num_streams=2) as channel:
        transfer, inbound, _, _ = ship(channel, receiver, kit.spec(job_id=base.job_id, ticket=forged))
        assert transfer.wait(5) is TransferStatus.FAILED
        assert isinstance(transfer.error, TicketRejected)
        assert inbound.info is None
        assert inbound.wire_bytes == 0


def test_expired_and_over_budget_tickets_are_refused(kit: Kit, receiver: TcpReceiver) -> None:
    base = kit.spec()
    expired = kit.signer.issue(base.job_id, 1, "acme", base.raw_bytes, ttl_s=-1)
    with TcpChannel(receiver.address, num_streams=1) as channel:
        transfer, _inbound, _, _ = ship(channel, receiver, kit.spec(job_id=base.job_id, ticket=expired))
        assert transfer.wait(5) is TransferStatus.FAILED
        assert "expired" in str(transfer.error)
        small = kit.spec(budget=1000)
        transfer, inbound, _, _ = ship(channel, receiver, kit.spec(job_id=small.job_id, ticket=small.ticket))
        assert transfer.wait(5) is TransferStatus.FAILED
        assert "budget" in str(transfer.error)
        assert inbound.wire_bytes == 0


def test_replayed_ticket_is_refused(kit: Kit, receiver: TcpReceiver) -> None:
    with TcpChannel(receiver.address, num_streams=2) as channel:
        transfer, _, _, _ = ship(channel, receiver, kit.spec(num_layers=2))
        assert transfer.wait(5) is TransferStatus.COMPLETED
        spec = transfer.spec
        again = receiver.expect(spec.job_id, spec.attempt, timeout_s=5)  # even with a reservation
        replay = channel.submit(Shipment(spec))
        assert replay.wait(5) is TransferStatus.FAILED
        assert isinstance(replay.error, TicketRejected)
        assert "replayed" in str(replay.error)
        assert again.wire_bytes == 0


def test_shipment_without_reservation_is_refused(kit: Kit, receiver: TcpReceiver) -> None:
    with TcpChannel(receiver.address, num_streams=1) as channel:
        transfer = channel.submit(Shipment(kit.spec()))
        assert transfer.wait(5) is TransferStatus.FAILED
        assert "no reservation" in str(transfer.error)


RECEIVER_PROCESS = """
import sys, time
from prfaas.transport.tcp_receiver import TcpReceiver
from prfaas.transport.tickets import TicketVerifier
rx = TcpReceiver(TicketVerifier({"k1": bytes.fromhex(sys.argv[1])}))
rx.expect(sys.argv[2], 1, timeout_s=60)
print(rx.address[1], flush=True)
time.sleep(60)
"""


def test_peer_killed_mid_shipment_fails_within_the_deadline_and_leaks_no_threads(kit: Kit) -> None:
    spec = kit.spec(num_layers=8, shape=(4, 1024, 64), timeout_s=4.0)
    peer = subprocess.Popen(
        [sys.executable, "-c", RECEIVER_PROCESS, KEY.hex(), spec.job_id], stdout=subprocess.PIPE, text=True
    )
    try:
        assert peer.stdout is not None
        port = int(peer.stdout.readline())
        before = threading.active_count()
        channel = TcpChannel(("127.0.0.1", port), num_streams=4, unavailable_after_s=1.0, connect_timeout_s=0.5)
        shipment = Shipment(spec)
        transfer = channel.submit(shipment)
        layers = layers_for(spec)
        shipment.add_layer(0, *layers[0])
        deadline = time.monotonic() + 3
        while transfer.stats.wire_bytes == 0 and time.monotonic() < deadline:
            time.sleep(0.005)
        peer.kill()  # kill -9: the decode region vanishes mid-shipment, no goodbye
        for index in range(1, 8):
            shipment.add_layer(index, *layers[index])
        start = time.monotonic()
        status = transfer.wait(10)
        assert status in (TransferStatus.FAILED, TransferStatus.TIMEOUT)
        assert isinstance(transfer.error, PeerUnavailable | TransferTimeout)
        assert time.monotonic() - start < 4.0
        channel.close()
        assert channel.queue.inflight_bytes == 0
        deadline = time.monotonic() + 5
        while threading.active_count() > before and time.monotonic() < deadline:
            time.sleep(0.05)
        assert threading.active_count() <= before, [t.name for t in threading.enumerate()]
    finally:
        peer.kill()
        peer.wait(5)


def test_silent_peer_times_out_at_the_deadline(kit: Kit) -> None:
    silent = socket.create_server(("127.0.0.1", 0))  # accepts, never answers HELLO
    try:
        with TcpChannel(silent.getsockname()[:2], num_streams=2, connect_timeout_s=0.3, unavailable_after_s=30) as ch:
            spec = kit.spec(timeout_s=1.0)
            shipment = Shipment(spec)
            transfer = ch.submit(shipment)
            fill(shipment, layers_for(spec))
            start = time.monotonic()
            assert transfer.wait(5) is TransferStatus.TIMEOUT
            assert time.monotonic() - start < 1.5
    finally:
        silent.close()


def test_a_peer_trickling_its_hello_reply_cannot_stretch_the_handshake_or_close(kit: Kit) -> None:
    """One byte of HELLO_OK every 0.3 s: each read is within the connect timeout, the handshake is not. The
    setup has one deadline, and `close` ends connections still in it, within its own timeout."""
    reply = encode(Frame(FrameType.HELLO_OK, payload=json_payload({"version": 1, "node": "r"})))
    server, stop, conns = socket.create_server(("127.0.0.1", 0)), threading.Event(), []

    def trickle(conn: socket.socket) -> None:
        with contextlib.suppress(OSError):
            conn.recv(4096)
            for byte in reply:
                if stop.wait(0.3):
                    return
                conn.send(bytes([byte]))

    def accept() -> None:
        with contextlib.suppress(OSError):
            while True:
                conn = server.accept()[0]
                conns.append(conn)
                threading.Thread(target=trickle, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        channel = TcpChannel(server.getsockname()[:2], num_streams=4, connect_timeout_s=1.0, unavailable_after_s=30)
        time.sleep(2.5)  # ~8 bytes each at most: every handshake gave up at its deadline and began anew
        assert channel.num_connected == 0 and len(conns) >= 8
        start = time.monotonic()
        channel.close(timeout_s=1.0)
        assert time.monotonic() - start < 1.5
        assert not any(stream.thread.is_alive() for stream in channel.streams)
    finally:
        stop.set()
        server.close()
        for conn in conns:
            conn.close()


def test_a_submit_racing_close_is_canceled_or_refused(kit: Kit, monkeypatch: pytest.MonkeyPatch) -> None:
    silent = socket.create_server(("127.0.0.1", 0))  # no stream ever connects
    channel = TcpChannel(silent.getsockname()[:2], num_streams=1, connect_timeout_s=0.3)
    add = channel.table.add

    def slow_add(transfer: object) -> None:  # `close` takes its snapshot of live transfers meanwhile
        time.sleep(0.3)
        add(transfer)  # type: ignore[arg-type]

    monkeypatch.setattr(channel.table, "add", slow_add)
    submitted: list[object] = []
    thread = threading.Thread(target=lambda: submitted.append(channel.submit(Shipment(kit.spec(timeout_s=30)))))
    try:
        thread.start()
        time.sleep(0.1)
        channel.close(timeout_s=1.0)
        thread.join(5)
        assert [t.status() for t in submitted] == [TransferStatus.CANCELED]  # type: ignore[attr-defined]
        with pytest.raises(PeerUnavailable):
            channel.submit(Shipment(kit.spec()))
    finally:
        silent.close()


def test_streams_can_be_added_and_retired_mid_shipment(kit: Kit, receiver: TcpReceiver) -> None:
    with TcpChannel(receiver.address, num_streams=2, max_inflight_bytes=256 << 10) as channel:
        spec = kit.spec(num_layers=8, shape=(4, 1024, 64))
        transfer, inbound, layers, shipment = ship(channel, receiver, spec, num_filled=3)
        channel.resize(6)
        for index in range(3, 6):
            shipment.add_layer(index, *layers[index])
        channel.resize(1)
        for index in range(6, 8):
            shipment.add_layer(index, *layers[index])
        assert transfer.wait(15) is TransferStatus.COMPLETED, transfer.error
        assert [inbound.layer(i, 1) for i in range(8)] == layers
        assert channel.num_streams == 1


def test_default_channel_adapts_its_stream_count(kit: Kit, receiver: TcpReceiver) -> None:
    with TcpChannel(receiver.address) as channel:
        assert channel.controller is not None
        assert channel.num_streams == channel.controller.initial
        transfer, _inbound, _, _ = ship(channel, receiver, kit.spec())
        assert transfer.wait(15) is TransferStatus.COMPLETED


def test_the_stream_count_and_transfer_outcomes_are_in_the_metrics(kit: Kit, receiver: TcpReceiver) -> None:
    from prometheus_client import REGISTRY

    peer = f"{receiver.address[0]}:{receiver.address[1]}"

    def value(name: str, **labels: str) -> float | None:
        return REGISTRY.get_sample_value(name, {"peer": peer, **labels})

    with TcpChannel(receiver.address) as channel:  # adaptive: the default
        transfer, _inbound, _layers, _ = ship(channel, receiver, kit.spec(codec="lossless"))
        assert transfer.wait(15) is TransferStatus.COMPLETED, transfer.error
        assert value("prfaas_kv_streams") == channel.num_streams == 4  # starts at 4
        assert value("prfaas_kv_transfers_total", status="completed") == 1
        assert value("prfaas_kv_raw_bytes_total", codec="lossless") == transfer.spec.raw_bytes
        assert value("prfaas_kv_wire_bytes_total") == transfer.stats.wire_bytes
        deadline = time.monotonic() + 2
        while value("prfaas_kv_streams_connected") != 4 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert value("prfaas_kv_streams_connected") == 4
    # a closed channel's (the pool closes idle ones) gauges go with it: not its last figures for good
    assert value("prfaas_kv_streams") is None and value("prfaas_kv_streams_connected") is None
    assert value("prfaas_kv_queueing_delay_seconds") is None
    assert value("prfaas_kv_transfers_total", status="completed") == 1  # counters stay
    # ... with the last channel to the peer: an old one closed after its replacement opened leaves them
    replacement = TcpChannel(receiver.address, num_streams=2)
    TcpChannel(receiver.address, num_streams=3).close()
    time.sleep(0.2)  # the replacement's next tick (every 50 ms) writes its own figure again
    assert value("prfaas_kv_streams") == 2
    replacement.close()
    assert value("prfaas_kv_streams") is None


def test_jobs_submitted_while_the_pool_connects_all_complete(kit: Kit, receiver: TcpReceiver) -> None:
    """Fresh pools with jobs submitted at once: streams connect and open shipments while other
    streams finish them. Before late OPENs of delivered shipments were answered with DONE,
    about 1 shipment in 60 here FAILED with UNKNOWN_SHIPMENT."""
    for _ in range(20):
        with TcpChannel(receiver.address, num_streams=3) as channel:
            shipped = [ship(channel, receiver, kit.spec(num_layers=3)) for _ in range(5)]
            for transfer, _inbound, _layers, _ in shipped:
                assert transfer.wait(15) is TransferStatus.COMPLETED, transfer.error


def test_a_receiver_that_stops_reading_does_not_wedge_the_sender(kit: Kit, monkeypatch: pytest.MonkeyPatch) -> None:
    """A receiver process that is alive but stuck (SIGSTOP) stops reading: a send that makes
    no progress for SEND_TIMEOUT_S drops its stream instead of holding the stream's write lock
    forever, so the transfer ends (FAILED or TIMEOUT at its deadline), and wait() and close()
    return; before, the deadline's CANCEL queued behind the stuck send and wedged them."""
    monkeypatch.setattr(sockets, "SEND_TIMEOUT_S", 1.0)
    spec = kit.spec(num_layers=16, shape=(8, 2048, 64), codec="lossless", timeout_s=6)  # 64 MB, incompressible
    layers = layers_for(spec)
    command = [sys.executable, str(PEER), "tcp", KEY.hex(), spec.job_id]
    peer = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    try:
        assert peer.stdout is not None
        port = json.loads(peer.stdout.readline())["port"]
        channel = TcpChannel(("127.0.0.1", port), num_streams=2, unavailable_after_s=1.0, connect_timeout_s=0.5)
        shipment = Shipment(spec)
        transfer = channel.submit(shipment)
        shipment.add_layer(0, *layers[0])
        wait_until_sent(transfer)
        os.kill(peer.pid, signal.SIGSTOP)
        for index in range(1, spec.num_layers):
            shipment.add_layer(index, *layers[index])
        assert transfer.wait(15) in (TransferStatus.FAILED, TransferStatus.TIMEOUT)
        start = time.monotonic()
        channel.close()
        assert time.monotonic() - start < 8.0
    finally:
        peer.kill()
        peer.wait(10)


def test_encode_threads_run_where_the_channel_was_made_not_where_a_layer_came_from() -> None:
    # A forward pinned to the engine's CPUs hands layers to the encoder from inside the pass
    # (engine/hf.py `pinned`): the pool's threads, started then, must not inherit that pin.
    home = os.sched_getaffinity(0)
    pool = encoder_pool(2, "test-encode")
    try:
        os.sched_setaffinity(0, {min(home)})
        try:
            seen = [pool.submit(os.sched_getaffinity, 0).result(10) for _ in range(4)]
        finally:
            os.sched_setaffinity(0, home)
    finally:
        pool.shutdown()
    assert all(cpus == home for cpus in seen)


def _until(condition: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.002)
    return condition()


def test_a_chunk_another_stream_took_is_not_put_back_by_the_stream_that_broke(
    kit: Kit, receiver: TcpReceiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stream A's send of chunk V fails; the other stream, B, takes V from the queue and is slow to write
    it (here: the test holds B's write lock). A's connection is then dropped: V is B's now, neither queued
    again nor released from the in-flight budget. Before, A's drop still counted V as its own: V went out
    twice, and while B's copy was on the wire its bytes counted for nothing against max_inflight_bytes."""
    dropped, resume = threading.Event(), threading.Event()
    sends: list[tuple[int, int, int]] = []
    streams: dict[str, TcpStream] = {}  # "broken": A, "slow": B
    real_send, real_drop = sockets.send_frame, TcpStream._drop

    def send_frame(sock: socket.socket, header: bytes, payload: bytes | memoryview) -> None:
        parsed = parse_header(header)
        key = (parsed.layer, parsed.part, parsed.chunk)
        if key == (0, 1, 0) and not streams:
            assert _until(lambda: transfer.unacked == 1)  # K arrived: the other stream waits for a chunk
            streams["broken"] = next(s for s in channel.streams if s.sock is sock)
            streams["slow"] = next(s for s in channel.streams if s is not streams["broken"])
            streams["slow"]._write_lock.acquire()
            raise BrokenPipeError("the connection broke")
        real_send(sock, header, payload)
        sends.append(key)

    def drop(stream: TcpStream) -> None:
        if stream is not streams.get("broken") or dropped.is_set():
            real_drop(stream)
            return
        chunk = transfer._unacked[(0, 1, 0)]
        _until(lambda: not chunk.queued)  # B took V (before: it was back in the queue as A's send failed)
        real_drop(stream)
        dropped.set()
        resume.wait(5)  # A reconnects (and takes chunks) only once the test has looked

    monkeypatch.setattr(sockets, "send_frame", send_frame)
    monkeypatch.setattr(TcpStream, "_drop", drop)
    with TcpChannel(receiver.address, num_streams=2) as channel:
        assert _until(lambda: channel.num_connected == 2)
        spec = kit.spec(num_layers=1, shape=(1, 64, 64))  # 8 KiB a part: one chunk each
        transfer, inbound, layers, shipment = ship(channel, receiver, spec, num_filled=0)
        assert _until(lambda: transfer.accepted)  # its OPEN is out: no control frame waits for B's lock
        fill(shipment, layers)
        try:
            assert dropped.wait(5)
            chunk = transfer._unacked[(0, 1, 0)]
            _until(lambda: not chunk.queued, timeout_s=2)
            assert not chunk.queued  # no second copy waits to be sent
            assert channel.queue.inflight_bytes == chunk.size  # B's copy counts
        finally:
            resume.set()
            if "slow" in streams:
                streams["slow"]._write_lock.release()
        assert transfer.wait(10) is TransferStatus.COMPLETED, transfer.error
        assert inbound.layer(0, 1) == layers[0]
        # B's send is recorded once its write returned, which may be after the receiver's ACK completed the transfer
        assert _until(lambda: (0, 1, 0) in sends) and sends.count((0, 1, 0)) == 1, sends
        assert transfer.stats.resent_chunks == 0
        assert _until(lambda: channel.queue.inflight_bytes == 0)


def test_a_reply_whose_payload_fails_its_checksum_is_not_acted_on(kit: Kit) -> None:
    """A bit flipped on the way turns the receiver's ACK of chunk (0, 0, 1) into one of (0, 0, 0), which it
    never stored. The sender refuses the reply (its payload fails payload_xxh3), drops the connection and
    resends what it had unacknowledged on a new one; before, it took (0, 0, 0) as delivered and the
    shipment could only time out."""
    server = socket.create_server(("127.0.0.1", 0))
    received: list[list[tuple[int, int, int]]] = []  # DATA chunks, per connection

    def serve(conn: socket.socket, keys: list[tuple[int, int, int]], first: bool) -> None:
        while True:
            frame, _ok = read_frame(conn)
            if frame.type is FrameType.HELLO:
                conn.sendall(encode(Frame(FrameType.HELLO_OK, payload=json_payload({"version": 1, "node": "rx"}))))
            elif frame.type is FrameType.OPEN:
                conn.sendall(encode(Frame(FrameType.OPEN_OK, frame.job_id, frame.attempt)))
            elif frame.type is FrameType.PING:
                conn.sendall(encode(Frame(FrameType.PONG, payload=frame.payload)))
            elif frame.type is FrameType.DATA:
                keys.append(frame.key)
                ack = bytearray(encode(Frame(FrameType.ACK, frame.job_id, frame.attempt,
                                             payload=ack_payload([frame.key]))))  # fmt: skip
                if first and frame.key == (0, 0, 1):
                    ack[HEADER_SIZE + 8] ^= 0x01  # the chunk index's low bit: the ACK reads (0, 0, 0)
                    conn.sendall(ack)
                elif not first:
                    conn.sendall(ack)
                    if len(set(keys)) == 4:
                        conn.sendall(encode(Frame(FrameType.DONE, frame.job_id, frame.attempt)))

    def accept() -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = server.accept()
                received.append([])
                with conn, contextlib.suppress(OSError, ConnectionError):
                    serve(conn, received[-1], len(received) == 1)

    threading.Thread(target=accept, daemon=True).start()
    try:
        with TcpChannel(server.getsockname()[:2], num_streams=1) as channel:
            spec = kit.spec(num_layers=1, shape=(1, 64, 64), chunk_bytes=4096, timeout_s=3)  # 2 chunks a part
            shipment = Shipment(spec)
            transfer = channel.submit(shipment)
            fill(shipment, layers_for(spec))
            assert transfer.wait(6) is TransferStatus.COMPLETED, transfer.error
            assert (0, 0, 0) in received[1]  # sent again: no ACK the receiver really sent named it
    finally:
        server.close()


def test_a_receiver_closing_while_a_reply_is_being_written_still_tells_its_senders(kit: Kit) -> None:
    """`close` cancels the shipments it expects; the CANCEL to a connection whose thread is writing a reply
    (an ACK; here the test holds the connection's writer) waits in its writer for that write to end. Before,
    the socket was closed at once with the CANCEL still queued, and the sender learned of the end only from
    its refused reconnects, `unavailable_after_s` later (FAILED with PeerUnavailable, not CANCELED)."""
    receiver = TcpReceiver(kit.verifier)
    with TcpChannel(receiver.address, num_streams=1, unavailable_after_s=3.0) as channel:
        transfer, inbound, _, _ = ship(channel, receiver, kit.spec(num_layers=1), num_filled=0)
        assert _until(lambda: transfer.accepted)
        (connection,) = receiver._connections._items
        closing = threading.Thread(target=receiver.close)
        connection.writer.lock.acquire()  # the connection's own thread is writing
        try:
            closing.start()
            assert _until(lambda: connection.writer.queued > 0)  # the CANCEL, queued behind that write
        finally:
            connection.writer.lock.release()
        closing.join(5)
        assert inbound.status() is TransferStatus.CANCELED
        assert transfer.wait(1) is TransferStatus.CANCELED, transfer.error
        assert "shutting down" in str(transfer.error)


def test_a_receiver_closing_waits_no_longer_than_its_drain_budget_on_a_peer_that_does_not_read(
    kit: Kit, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`close` lets queued frames out for DRAIN_S at most, however many connections it drains: one whose peer
    stopped reading gets what fits in the socket by then, and no more. Before, `drain` saw room and sent the
    whole queue with one blocking send, which waited the socket's send timeout (10 s) on that peer."""
    monkeypatch.setattr(sockets, "SEND_TIMEOUT_S", 4.0)  # (shortened: what a blocked send waited before)
    receiver = TcpReceiver(kit.verifier, sock_buf_bytes=64 << 10)
    peer = socket.create_connection(receiver.address)
    try:
        peer.sendall(encode(Frame(FrameType.HELLO, payload=json_payload({"versions": [1], "node": "peer"}))))
        assert _until(lambda: len(receiver._connections._items) == 1)
        (connection,) = receiver._connections._items
        cancels = [encode(Frame(FrameType.CANCEL, uuid.uuid4().bytes, 1, payload=b"x" * 1000)) for _ in range(4096)]
        with connection.writer.lock:  # a write in progress: ~4 MB of CANCELs queue behind it, which the peer,
            for cancel in cancels:  # reading nothing, never takes
                connection.writer.post(cancel)
        start = time.monotonic()
        receiver.close()
        assert time.monotonic() - start < receiver_base.DRAIN_S + 0.5
    finally:
        peer.close()


def test_a_transfer_canceled_before_its_open_goes_out_leaves_no_shipment_open_on_the_receiver(
    kit: Kit, receiver: TcpReceiver
) -> None:
    """Stream 1 took a chunk of a shipment it has not opened yet (stream 0, holding its OPEN, is busy: the test
    holds both streams' write locks), and the transfer is canceled before that OPEN goes out: no stream had
    opened it, so no CANCEL goes anywhere. The late OPEN would open a shipment nobody cancels, kept (and its
    reservation) until its deadline: it must not go out."""
    with TcpChannel(receiver.address, num_streams=2) as channel:
        warm = kit.spec(num_layers=1, shape=(1, 16, 64), timeout_s=30)  # both streams connected
        assert ship(channel, receiver, warm)[0].wait(10) is TransferStatus.COMPLETED
        assert _until(lambda: channel.num_connected == 2)
        first, second = channel.streams
        entered, taken = threading.Event(), threading.Event()
        get = channel.queue.get

        def get_and_tell(*args: Any, **kwargs: Any) -> Any:
            mine = threading.current_thread() is second.thread
            if mine:
                entered.set()
            chunk = get(*args, **kwargs)
            if chunk is not None and mine:
                taken.set()
            return chunk

        channel.queue.get = get_and_tell  # type: ignore[method-assign]
        assert entered.wait(5)  # stream 1 takes every chunk from now on through `get_and_tell`
        spec = kit.spec(num_layers=1, shape=(1, 16, 64), timeout_s=30)
        inbound = receiver.expect(spec.job_id, 1, 30)
        shipment = Shipment(spec)
        with first._write_lock, second._write_lock:
            transfer = channel.submit(shipment)  # its OPEN waits for stream 0's thread
            assert _until(lambda: not first.has_control())  # taken, the thread waits for its write lock
            shipment.add_layer(0, *layers_for(spec)[0])
            assert taken.wait(5)  # stream 1 took a chunk, and waits for its write lock to open the shipment
            transfer.cancel()
        assert not _until(lambda: inbound.info is not None, 1.0), "the receiver opened a canceled shipment"
        assert transfer.status() is TransferStatus.CANCELED
