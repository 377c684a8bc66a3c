"""What the shared-memory transport adds to the conformance suite: the arena allocator, KV
placed in the arena (layers are views of it, memory comes back on release), inline fallback
when the arena is full, checksums on request, and a TCP receiver sharing the arena."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from transport_kit import KEY, Kit, layers_for, ship, wait_until_sent

from prfaas.transport.admission import ReceiverLimits
from prfaas.transport.api import Shipment, TransferStatus
from prfaas.transport.arena import PAGE, Arena
from prfaas.transport.endpoints import choose, host_id, is_loopback, parse_endpoint, parse_endpoints, parse_hostport
from prfaas.transport.errors import PeerUnavailable
from prfaas.transport.framing import HEADER_SIZE, Frame, FrameType, encode, encode_header, json_payload, read_frame
from prfaas.transport.open_info import OpenInfo
from prfaas.transport.shm_receiver import ShmReceiver
from prfaas.transport.shm_sender import ShmChannel
from prfaas.transport.tcp_receiver import TcpReceiver
from prfaas.transport.tcp_sender import TcpChannel
from prfaas.transport.writer import socket_room

PEER = Path(__file__).with_name("conformance_peer.py")


def test_arena_hands_out_page_aligned_buffers_and_reuses_them_after_the_quarantine() -> None:
    arena = Arena(16 * PAGE, quarantine_s=0.05)
    try:
        a, b = arena.get(100), arena.get(PAGE + 1)
        assert isinstance(a, memoryview) and isinstance(b, memoryview)
        assert (arena.offset_of(a), arena.offset_of(b)) == (0, PAGE)  # 100 bytes still take a page
        assert arena.used_bytes == 3 * PAGE
        assert isinstance(arena.get(14 * PAGE), bytearray)  # 13 pages free: a heap buffer instead
        arena.put(a)
        arena.put(a)  # a second put is ignored
        arena.put(bytearray(10))  # not arena memory: ignored
        assert isinstance(arena.get(PAGE), memoryview) and arena.used_bytes == 4 * PAGE  # not page 0 yet
        time.sleep(0.06)
        arena.put(b)
        time.sleep(0.06)
        big = arena.get(3 * PAGE)  # pages 0..2 merged back into one free range
        assert arena.offset_of(big) == 0
    finally:
        arena.close()


def test_raw_layers_are_views_of_the_arena_and_release_gives_the_memory_back(kit: Kit) -> None:
    with ShmReceiver(kit.verifier, arena_bytes=8 << 20) as rx, ShmChannel(rx.path) as channel:
        rx.arena.quarantine_s = 0.0
        spec = kit.spec(num_layers=3, shape=(2, 512, 64))
        transfer, inbound, layers, _ = ship(channel, rx, spec, expect_timeout_s=10)
        assert transfer.wait(10) is TransferStatus.COMPLETED, transfer.error
        k, v = inbound.layer(0, 1)
        assert rx.arena.offset_of(k) is not None and rx.arena.offset_of(v) is not None  # no copy on this side
        assert bytes(k) == layers[0][0]
        assert rx.arena.used_bytes >= spec.raw_bytes
        inbound.release()
        assert rx.arena.used_bytes == 0


def test_a_full_arena_falls_back_to_inline_payloads(kit: Kit) -> None:
    with ShmReceiver(kit.verifier, arena_bytes=64 << 10) as rx, ShmChannel(rx.path) as channel:
        spec = kit.spec(num_layers=2, shape=(2, 512, 64))  # 128 KiB parts: no room
        transfer, inbound, layers, _ = ship(channel, rx, spec, expect_timeout_s=10)
        assert transfer.wait(10) is TransferStatus.COMPLETED, transfer.error
        assert [tuple(map(bytes, inbound.layer(i, 1))) for i in range(2)] == layers
        assert rx.arena.offset_of(inbound.layer(0, 1)[0]) is None


@pytest.mark.parametrize("codec", ["raw", "lossless"])
def test_checksummed_shipments_arrive_verified(kit: Kit, codec: str) -> None:
    with ShmReceiver(kit.verifier, arena_bytes=8 << 20) as rx, ShmChannel(rx.path, checksums=True) as channel:
        spec = kit.spec(num_layers=2, shape=(2, 256, 64), codec=codec)
        transfer, inbound, layers, _ = ship(channel, rx, spec, expect_timeout_s=10)
        assert transfer.wait(10) is TransferStatus.COMPLETED, transfer.error
        assert inbound.wait(5) is TransferStatus.COMPLETED
        assert [tuple(map(bytes, inbound.layer(i, 1))) for i in range(2)] == layers


def test_a_tcp_receiver_sharing_the_arena_serves_both_transports(kit: Kit) -> None:
    """A decode region: one set of expected shipments, reached over TCP or shared memory."""
    arena = Arena(8 << 20, quarantine_s=0.0)
    tcp = TcpReceiver(kit.verifier, pool=arena)
    shm = ShmReceiver(kit.verifier, arena=arena, core=tcp.core)
    try:
        with TcpChannel(tcp.address, num_streams=2) as over_tcp, ShmChannel(shm.path) as over_shm:
            for channel in (over_tcp, over_shm):
                spec = kit.spec(num_layers=2, shape=(2, 512, 64))
                transfer, inbound, layers, _ = ship(channel, tcp, spec, seed=5, expect_timeout_s=10)
                assert transfer.wait(10) is TransferStatus.COMPLETED, transfer.error
                assert [tuple(map(bytes, inbound.layer(i, 1))) for i in range(2)] == layers
                assert arena.offset_of(inbound.layer(1, 1)[1]) is not None
                inbound.release()
        assert arena.used_bytes == 0
    finally:
        shm.close()
        tcp.close()


def test_endpoints_parse_and_the_fastest_usable_one_is_chosen() -> None:
    assert str(parse_endpoint("10.0.0.5:7400")) == "10.0.0.5:7400"
    assert parse_endpoint("webrtc://decode-b").region == "decode-b"
    for bad in ("nohost", "shm://only-id", "webrtc://", "h:0", "h:99999"):
        with pytest.raises(ValueError, match="is not"):
            parse_endpoint(bad)
    with pytest.raises(ValueError, match="no KV endpoint"):
        parse_endpoints(" , ")
    here = host_id()
    import tempfile

    with tempfile.NamedTemporaryFile() as sock:  # the receiver's socket path exists
        mine = f"127.0.0.1:7400,shm://{here}{sock.name},webrtc://d"
        assert choose(parse_endpoints(mine)).kind == "shm"
        assert choose(parse_endpoints(f"shm://other-host{sock.name},127.0.0.1:7400")).kind == "tcp"
    assert choose(parse_endpoints(f"shm://{here}/gone.sock,webrtc://d")).kind == "webrtc"  # no socket
    with pytest.raises(ValueError, match="can be reached"):
        choose(parse_endpoints("shm://other/x.sock"))


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("2001:db8::5", "IPv6 address needs"),  # was host '2001:db8:' port 5
        ("::1", "IPv6 address needs"),  # was host ':' port 1
        ("fd00::5:7400", "IPv6 address needs"),  # port 7400, or fd00::5:7400 with none: not guessed
        ("[::1", "bracketed"),
        ("[host:7400", "bracketed"),
        ("[::1]7400", "bracketed"),
        ("[]:7400", "no host"),
        ("host]:7400", "stray bracket"),
        ("h:\u0667\u0664\u0660\u0660", "port"),  # Arabic-Indic 7400: str.isdigit() takes it, int() reads it
        ("h:+7400", "port"),
    ],
)
def test_an_ipv6_address_needs_brackets_and_malformed_ones_are_refused(text: str, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        parse_endpoint(text)
    with pytest.raises(ValueError, match=reason):
        parse_hostport(text)


def test_bracketed_ipv6_endpoints_parse_and_print_back() -> None:
    endpoint = parse_endpoint("[2001:db8::5]:7400")
    assert (endpoint.host, endpoint.port, str(endpoint)) == ("2001:db8::5", 7400, "[2001:db8::5]:7400")
    assert parse_hostport("[::]:0") == ("::", 0) and parse_hostport("decode.example:7400") == ("decode.example", 7400)
    assert is_loopback("[::1]:7000") and not is_loopback("[2001:db8::5]:7000")


@contextlib.contextmanager
def receiver_process(job_id: str) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """A shared-memory receiver in a process of its own expecting `job_id` (conformance_peer.py): the process
    (to SIGSTOP) and its socket's path. Killed on exit, stopped or not."""
    peer = subprocess.Popen([sys.executable, str(PEER), "shm", KEY.hex(), job_id], stdout=subprocess.PIPE, text=True)
    try:
        assert peer.stdout is not None
        yield peer, json.loads(peer.stdout.readline())["path"]
    finally:
        os.kill(peer.pid, signal.SIGCONT)
        peer.kill()
        peer.wait(10)


def test_a_receiver_that_stops_reading_fails_the_transfer_long_before_its_deadline(kit: Kit) -> None:
    """A receiver process that is alive but stuck (SIGSTOP) stops reading the control socket:
    the channel's sends are bounded (send_timeout_s), so the transfer fails with
    PeerUnavailable in seconds instead of waiting for its 60 s deadline, and the next submit
    gets a fresh connection."""
    spec = kit.spec(num_layers=16, shape=(4, 1024, 64), codec="lossless", timeout_s=60)  # inline payloads
    layers = layers_for(spec)  # random bytes: the lossless stage keeps their 16 MB
    with receiver_process(spec.job_id) as (peer, path), ShmChannel(path, send_timeout_s=1.0) as channel:
        shipment = Shipment(spec)
        transfer = channel.submit(shipment)
        shipment.add_layer(0, *layers[0])
        wait_until_sent(transfer)
        os.kill(peer.pid, signal.SIGSTOP)
        start = time.monotonic()
        for index in range(1, spec.num_layers):
            shipment.add_layer(index, *layers[index])
        assert transfer.wait(20) is TransferStatus.FAILED
        assert isinstance(transfer.error, PeerUnavailable), transfer.error
        assert time.monotonic() - start < 8.0


def test_a_placed_chunk_header_after_its_cancel_does_not_desync_the_control_socket(kit: Kit) -> None:
    """A sender's copy thread may write a placed chunk's DATA header (its payload is in the arena, not on the
    socket) after the CANCEL another thread wrote. The receiver still knows the placement: it reads no
    payload after that header, and the next frame (a PING here) is read as a frame."""
    with ShmReceiver(kit.verifier, arena_bytes=8 << 20) as rx:
        spec = kit.spec(num_layers=1, shape=(1, 64, 64), chunk_bytes=4096)
        rx.expect(spec.job_id, spec.attempt, 10)
        job = uuid.UUID(spec.job_id).bytes
        info = OpenInfo(spec.dtype, spec.layer_shapes, 0, spec.chunk_bytes)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(5)
            sock.connect(rx.path)
            sock.sendall(encode(Frame(FrameType.HELLO, payload=json_payload({"versions": [1], "node": "p"}))))
            data, fds, _flags, _addr = socket.recv_fds(sock, HEADER_SIZE, 1)
            for fd in fds:
                os.close(fd)
            assert read_frame(sock, bytes(data))[0].type is FrameType.HELLO_OK
            sock.sendall(encode(Frame(FrameType.OPEN, job, 1, payload=json_payload(info.to_json(spec.ticket)))))
            opened = read_frame(sock)[0]
            assert opened.type is FrameType.OPEN_OK and opened.json()["parts"]  # placed in the arena
            placed = Frame(FrameType.DATA, job, 1, 0, 0, 0, 0, 2, spec.part_bytes(0), bytes(4096))
            sock.sendall(encode(Frame(FrameType.CANCEL, job, 1)) + encode_header(placed, checksum_payload=False))
            sock.sendall(encode(Frame(FrameType.PING, payload=b"12345678")))
            reply = read_frame(sock)[0]
            while reply.type is not FrameType.PONG:  # what the receiver says of the canceled shipment first
                assert reply.type in (FrameType.CANCEL, FrameType.ERROR), reply
                reply = read_frame(sock)[0]
            assert bytes(reply.payload) == b"12345678"


def test_canceling_a_transfer_never_waits_on_a_receiver_that_stopped_reading(kit: Kit) -> None:
    """A copy thread waits in a send to a stuck receiver (SIGSTOP) holding the control socket: the thread
    that cancels a transfer (the prefill region's Cancel, a deadline, close) posts its CANCEL and goes on."""
    spec = kit.spec(num_layers=16, shape=(4, 1024, 64), codec="lossless", timeout_s=60)  # inline payloads
    layers = layers_for(spec)
    with receiver_process(spec.job_id) as (peer, path):
        with ShmChannel(path, send_timeout_s=5.0) as channel:
            shipment = Shipment(spec)
            transfer = channel.submit(shipment)
            shipment.add_layer(0, *layers[0])
            wait_until_sent(transfer)
            os.kill(peer.pid, signal.SIGSTOP)
            for index in range(1, spec.num_layers):
                shipment.add_layer(index, *layers[index])
            time.sleep(1.0)  # the socket is full: a copy thread waits in its send
            start = time.monotonic()
            transfer.cancel()
            assert time.monotonic() - start < 0.5
            assert transfer.status() is TransferStatus.CANCELED
            start = time.monotonic()
        assert time.monotonic() - start < 6.0  # close: the copy thread's send ends at its 5 s timeout


def test_one_sending_process_holds_at_most_max_per_peer_verified_connections(kit: Kit) -> None:
    """A shared-memory sender is named by its process (SO_PEERCRED): its verified connections past
    `max_per_peer` are closed, as a TCP peer's are, so one process cannot take every slot."""
    with ShmReceiver(kit.verifier, arena_bytes=1 << 20, limits=ReceiverLimits(max_per_peer=2)) as rx:
        socks = []
        try:
            for _ in range(6):  # each opens a shipment of its own, whose ticket verifies it
                spec = kit.spec(num_layers=1, shape=(1, 16, 64), codec="lossless")
                rx.expect(spec.job_id, spec.attempt, 60)
                body = json_payload(OpenInfo(spec.dtype, spec.layer_shapes, 1, spec.chunk_bytes).to_json(spec.ticket))
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.connect(rx.path)
                sock.sendall(encode(Frame(FrameType.HELLO, payload=json_payload({"versions": [1], "node": "p"}))))
                sock.sendall(encode(Frame(FrameType.OPEN, uuid.UUID(spec.job_id).bytes, 1, payload=body)))
                socks.append(sock)
            deadline = time.monotonic() + 5
            while rx.num_connections != 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(0.3)  # a few reap intervals more: two stay
            assert rx.num_connections == 2
        finally:
            for sock in socks:
                sock.close()


def test_a_late_second_break_of_an_old_link_fails_no_transfer_of_the_new_one(kit: Kit) -> None:
    """The reader and a copy thread may both find a control socket broken: the first fails what was live on
    it, the next submit connects anew. The other's later call must not fail the new link's transfers."""
    with ShmReceiver(kit.verifier, arena_bytes=8 << 20) as rx, ShmChannel(rx.path) as channel:
        first = kit.spec(num_layers=1, shape=(1, 16, 64), timeout_s=30)
        rx.expect(first.job_id, 1, 30)
        old = channel.submit(Shipment(first))
        link = channel._link
        assert link is not None
        channel._broken(link, "control socket broken")
        assert old.status() is TransferStatus.FAILED
        second = kit.spec(num_layers=1, shape=(1, 16, 64), timeout_s=30)
        rx.expect(second.job_id, 1, 30)
        shipment = Shipment(second)
        new = channel.submit(shipment)
        channel._broken(link, "control socket broken")  # the copy thread's late call on the old link
        assert new.status() is not TransferStatus.FAILED
        for index, (k, v) in enumerate(layers_for(second)):
            shipment.add_layer(index, k, v)
        assert new.wait(10) is TransferStatus.COMPLETED


def test_a_cancel_posted_while_the_receiver_did_not_read_goes_out_once_it_reads(kit: Kit) -> None:
    """The receiver (SIGSTOP) left the control socket too full to take the CANCEL at once, and no copy thread
    writes after it: the channel's reaper sends it once the receiver reads again (it stayed queued for good)."""
    spec = kit.spec(num_layers=16, shape=(1, 256, 64), codec="lossless", timeout_s=60)  # 32 KiB parts, inline
    layers = layers_for(spec)
    with receiver_process(spec.job_id) as (peer, path), ShmChannel(path) as channel:
        shipment = Shipment(spec)
        transfer = channel.submit(shipment)
        shipment.add_layer(0, *layers[0])
        wait_until_sent(transfer)
        os.kill(peer.pid, signal.SIGSTOP)
        for index in (1, 2):  # ~128 KiB unread: written whole, and the socket has no room left
            shipment.add_layer(index, *layers[index])
        link = channel._link
        assert link is not None
        deadline = time.monotonic() + 10  # until those writes are done and left the socket full
        while (socket_room(link.sock.fileno)() or link.writer.lock.locked()) and time.monotonic() < deadline:
            time.sleep(0.05)
        if socket_room(link.sock.fileno)():
            pytest.skip("this host's socket buffers take 128 KiB with room to spare")
        transfer.cancel()
        assert link.writer.queued == 1  # posted, not sent
        os.kill(peer.pid, signal.SIGCONT)
        deadline = time.monotonic() + 3
        while link.writer.queued and time.monotonic() < deadline:
            time.sleep(0.05)
        assert link.writer.queued == 0
