"""A KV receiver's limits (transport/admission.py) on real sockets: the handshake deadline,
frame sizes checked before any payload is read, the caps on connections, and the KV port
under abuse while a real shipment goes through."""

from __future__ import annotations

import contextlib
import json
import queue
import resource
import selectors
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import xxhash
from transport_kit import KEY, Kit, fill, layers_for, ship

from prfaas.transport.admission import ReceiverLimits
from prfaas.transport.api import Shipment, ShipmentSpec, TransferStatus
from prfaas.transport.framing import ErrorCode, Frame, FrameType, encode, encode_header, json_payload, read_frame
from prfaas.transport.open_info import OpenInfo
from prfaas.transport.tcp_receiver import TcpReceiver
from prfaas.transport.tcp_sender import TcpChannel

PEER = Path(__file__).with_name("receiver_peer.py")
HELLO = encode(Frame(FrameType.HELLO, payload=json_payload({"versions": [1], "node": "abuser"})))
CLAIM = memoryview(bytes(16 << 20))  # what the abusive headers say follows them (never sent)


def claiming(frame_type: FrameType) -> bytes:
    """A well-formed 64-byte header that claims a 16 MiB payload."""
    job = uuid.uuid4().bytes
    frame = Frame(frame_type, job, 1, chunk=0, chunk_count=1, raw_len=len(CLAIM), payload=CLAIM)
    return encode_header(frame, checksum_payload=False)


ABUSE = {  # what each kind of abusive connection sends, right after connecting
    "header before HELLO": lambda: claiming(FrameType.DATA),
    "HELLO claiming 16 MiB": lambda: claiming(FrameType.HELLO),
    "DATA header after HELLO": lambda: HELLO + claiming(FrameType.DATA),
}


class Closures:
    """When the receiver closed each socket (EOF or reset), watched from a thread of its own."""

    def __init__(self) -> None:
        self.opened: dict[socket.socket, float] = {}
        self.closed: dict[socket.socket, float] = {}
        self._new: queue.Queue[socket.socket] = queue.Queue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="test-closures", daemon=True)
        self._thread.start()

    def add(self, sock: socket.socket, opened: float) -> None:
        self.opened[sock] = opened
        self._new.put(sock)

    def wait_all(self, timeout_s: float) -> bool:
        end = time.monotonic() + timeout_s
        while len(self.closed) < len(self.opened) and time.monotonic() < end:
            time.sleep(0.05)
        return len(self.closed) == len(self.opened)

    def _run(self) -> None:
        with selectors.DefaultSelector() as selector:
            while not self._stop.is_set():
                while not self._new.empty():
                    sock = self._new.get()
                    sock.setblocking(False)
                    selector.register(sock, selectors.EVENT_READ)
                for key, _ in selector.select(0.01):
                    sock = key.fileobj
                    assert isinstance(sock, socket.socket)
                    try:
                        data = sock.recv(65536)  # an ERROR frame, then EOF
                    except BlockingIOError:
                        continue
                    except OSError:
                        data = b""
                    if not data:
                        self.closed[sock] = time.monotonic()
                        selector.unregister(sock)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for sock in self.opened:
            sock.close()


class PeerReceiver:
    """receiver_peer.py: a TcpReceiver process, its RSS, and the shipments it was told to expect."""

    def __init__(self) -> None:
        command = [sys.executable, str(PEER), KEY.hex()]
        self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.address = ("127.0.0.1", self._read()["port"])
        self.process = psutil.Process(self.proc.pid)

    def _read(self) -> dict[str, object]:
        assert self.proc.stdout is not None
        reply: dict[str, object] = json.loads(self.proc.stdout.readline())
        return reply

    def ask(self, **command: str) -> dict[str, object]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def rss(self) -> int:
        return int(self.process.memory_info().rss)

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


def digest(layers: list[tuple[bytes, bytes]]) -> str:
    return xxhash.xxh3_64(b"".join(k + v for k, v in layers)).hexdigest()  # as the peer hashes, part by part


def shipped_bit_exactly(peer: PeerReceiver, channel: TcpChannel, spec: ShipmentSpec, seed: int) -> None:
    """Ship `spec` to the peer process; assert it arrived whole and bit for bit."""
    peer.ask(expect=spec.job_id)
    layers = layers_for(spec, seed)
    shipment = Shipment(spec)
    transfer = channel.submit(shipment)
    fill(shipment, layers)
    assert transfer.wait(spec.timeout_s) is TransferStatus.COMPLETED, transfer.error
    assert peer.ask(digest=spec.job_id) == {"status": "completed", "xxh3": digest(layers)}


@pytest.fixture
def peer() -> Iterator[PeerReceiver]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 4096:  # 1,500 abusive sockets here, as many accepted there (the peer inherits the limit)
        if hard != resource.RLIM_INFINITY and hard < 4096:
            pytest.skip(f"needs 4,096 file descriptors, the hard limit is {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (4096, hard))
    receiver = PeerReceiver()
    try:
        yield receiver
    finally:
        receiver.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_kv_port_abuse_costs_little_memory_is_closed_in_time_and_a_real_shipment_completes(
    kit: Kit, peer: PeerReceiver
) -> None:
    """500 idle connections plus 1,000 headers claiming 16 MiB payloads (before HELLO, as a
    HELLO, after HELLO), from the address a real sender uses: the receiver's RSS grows by less
    than 64 MiB, every abusive connection is closed within 3 s of connecting, and a shipment
    sent meanwhile completes bit-exactly."""
    closures = Closures()
    channel = TcpChannel(peer.address, num_streams=2)
    try:
        shipped_bit_exactly(peer, channel, kit.spec(), seed=1)  # the pool is up, verified, warm
        baseline = peer.rss()
        peak = [baseline]
        sampling = threading.Event()

        def sample() -> None:
            while not sampling.wait(0.01):
                peak[0] = max(peak[0], peer.rss())

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        for _ in range(500):
            closures.add(socket.create_connection(peer.address, timeout=5), time.monotonic())
        spec = kit.spec(num_layers=8)
        peer.ask(expect=spec.job_id)
        layers = layers_for(spec, seed=2)
        shipment = Shipment(spec)
        transfer = channel.submit(shipment)  # the real shipment, while the abuse goes on
        fill(shipment, layers)
        for index in range(1000):
            sock = socket.create_connection(peer.address, timeout=5)
            opened = time.monotonic()
            with contextlib.suppress(OSError):  # already closed (evicted): the watch sees it
                sock.sendall(list(ABUSE.values())[index % 3]())
            closures.add(sock, opened)
        assert transfer.wait(30) is TransferStatus.COMPLETED, transfer.error
        assert peer.ask(digest=spec.job_id) == {"status": "completed", "xxh3": digest(layers)}
        assert closures.wait_all(5.0), f"{len(closures.opened) - len(closures.closed)} abusive connections open"
        sampling.set()
        sampler.join(5)
        slowest = max(closures.closed[s] - closures.opened[s] for s in closures.opened)
        growth_mib = (peak[0] - baseline) / 2**20
        print(f"abuse: RSS +{growth_mib:.1f} MiB (baseline {baseline / 2**20:.0f} MiB), slowest close {slowest:.2f} s")
        assert slowest < 3.0
        assert growth_mib < 64
        shipped_bit_exactly(peer, channel, kit.spec(num_layers=2), seed=3)  # and it still serves
    finally:
        channel.close()
        closures.close()


def _exchange(address: tuple[str, int], data: bytes) -> Frame | None:
    """Send `data` on a fresh connection: the receiver's reply (None: closed without one);
    asserts the receiver then closes the connection."""
    with socket.create_connection(address, timeout=5) as sock:
        sock.sendall(data)
        reply: Frame | None = None
        try:
            while reply is None or reply.type is FrameType.HELLO_OK:
                reply, _ok = read_frame(sock)
        except ConnectionError:
            return reply
        assert sock.recv(1) == b""
        return reply


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (claiming(FrameType.DATA), "DATA payload of 16777216 bytes exceeds the 4096-byte limit before HELLO"),
        (claiming(FrameType.HELLO), "HELLO payload of 16777216 bytes exceeds the 4096-byte limit before HELLO"),
        (HELLO + claiming(FrameType.DATA), "DATA payload of 16777216 bytes exceeds the 65536-byte limit on this "
         "connection"),  # no OPEN accepted on it: no chunk size negotiated
        (HELLO + claiming(FrameType.OPEN), "OPEN payload of 16777216 bytes exceeds the 65536-byte limit on this "
         "connection"),
    ],
)  # fmt: skip
def test_frames_over_the_limits_are_refused_before_their_payload_is_read(kit: Kit, data: bytes, message: str) -> None:
    with TcpReceiver(kit.verifier) as rx:
        reply = _exchange(rx.address, data)
        assert reply is not None and reply.type is FrameType.ERROR
        assert reply.json() == {"code": ErrorCode.BAD_FRAME, "message": message}


def test_data_is_bounded_by_the_chunk_size_the_connection_negotiated(kit: Kit) -> None:
    """After an OPEN of 64 KiB chunks is accepted, a DATA frame may carry 64 KiB (not 8 KiB, the
    bound before it), and not a byte more."""
    with TcpReceiver(kit.verifier, limits=ReceiverLimits(max_control_bytes=8 << 10)) as rx:
        spec = kit.spec(num_layers=1, chunk_bytes=64 << 10)
        rx.expect(spec.job_id, spec.attempt, 10)
        job = uuid.UUID(spec.job_id).bytes
        info = OpenInfo(spec.dtype, spec.layer_shapes, 0, spec.chunk_bytes)
        opening = encode(Frame(FrameType.OPEN, job, 1, payload=json_payload(info.to_json(spec.ticket))))
        big = encode_header(
            Frame(FrameType.DATA, job, 1, chunk=0, chunk_count=1, raw_len=1, payload=CLAIM[: (64 << 10) + 1]),
            checksum_payload=False,
        )
        with socket.create_connection(rx.address, timeout=5) as sock:
            sock.sendall(HELLO + opening + big)
            replies = [read_frame(sock)[0] for _ in range(3)]
            assert [r.type for r in replies] == [FrameType.HELLO_OK, FrameType.OPEN_OK, FrameType.ERROR]
            assert "65537 bytes exceeds the 65536-byte limit" in replies[2].json()["message"]


def test_a_connection_that_does_not_say_hello_in_time_is_closed(kit: Kit) -> None:
    with TcpReceiver(kit.verifier, limits=ReceiverLimits(handshake_timeout_s=0.5)) as rx:
        with socket.create_connection(rx.address, timeout=5) as silent:
            start = time.monotonic()
            assert silent.recv(1) == b""
            assert 0.4 < time.monotonic() - start < 2.0
        with socket.create_connection(rx.address, timeout=5) as greeted:  # HELLO in time: kept
            greeted.sendall(HELLO)
            assert read_frame(greeted)[0].type is FrameType.HELLO_OK
            greeted.settimeout(1.0)
            with pytest.raises(TimeoutError):
                greeted.recv(1)


def test_unverified_connections_past_the_cap_evict_the_oldest_never_a_verified_one(kit: Kit) -> None:
    limits = ReceiverLimits(max_connections=6, max_unverified=3, handshake_timeout_s=30)
    with TcpReceiver(kit.verifier, limits=limits) as rx, TcpChannel(rx.address, num_streams=1) as channel:
        transfer, _inbound, _, _ = ship(channel, rx, kit.spec(num_layers=2))
        assert transfer.wait(10) is TransferStatus.COMPLETED  # its one stream carried a ticket
        stream_socket = channel.streams[0].sock
        idle = [socket.create_connection(rx.address, timeout=5) for _ in range(8)]
        try:
            for sock in idle[:5]:  # the oldest five were evicted as newer ones came
                assert sock.recv(1) == b""
            for sock in idle[5:]:
                sock.settimeout(0.3)
                with pytest.raises(TimeoutError):
                    sock.recv(1)
            transfer, _inbound, _, _ = ship(channel, rx, kit.spec(num_layers=2))
            assert transfer.wait(10) is TransferStatus.COMPLETED, transfer.error
            assert channel.streams[0].sock is stream_socket  # the verified stream was never closed
        finally:
            for sock in idle:
                sock.close()


def test_when_every_connection_is_verified_new_ones_are_refused(kit: Kit) -> None:
    limits = ReceiverLimits(max_connections=2, max_unverified=1, handshake_timeout_s=30)
    with TcpReceiver(kit.verifier, limits=limits) as rx, contextlib.ExitStack() as stack:
        channels = []
        for _ in range(2):  # one after the other: each proves itself before the next connects
            channels.append(stack.enter_context(TcpChannel(rx.address, num_streams=1)))
            transfer, _inbound, _, _ = ship(channels[-1], rx, kit.spec(num_layers=1))
            assert transfer.wait(10) is TransferStatus.COMPLETED, transfer.error
        with socket.create_connection(rx.address, timeout=5) as third:
            assert third.recv(1) == b""  # refused at once
        transfer, _inbound, _, _ = ship(channels[0], rx, kit.spec(num_layers=1))
        assert transfer.wait(10) is TransferStatus.COMPLETED, transfer.error


def test_a_ticket_the_receiver_refuses_proves_nothing(kit: Kit) -> None:
    """Plaintext: a ticket sniffed off the wire (valid, but its shipment is not expected here, or done) does
    not make a connection verified: such connections are evicted for a prefill region's, which ships (before,
    each counted as verified, and two of them kept the real sender out until the ticket expired)."""
    limits = ReceiverLimits(max_connections=2, max_unverified=1, handshake_timeout_s=30)
    with TcpReceiver(kit.verifier, limits=limits) as rx:
        stale = kit.spec(num_layers=1)  # its ticket: valid, for a shipment no reservation expects
        info = OpenInfo("bfloat16", stale.layer_shapes, 0, 64 << 10).to_json(stale.ticket)
        job = uuid.UUID(stale.job_id).bytes
        squatters = []
        for _ in range(2):
            sock = socket.create_connection(rx.address, timeout=5)
            sock.sendall(HELLO + encode(Frame(FrameType.OPEN, job, 1, payload=json_payload(info))))
            replies = [read_frame(sock)[0].type for _ in range(2)]
            assert replies == [FrameType.HELLO_OK, FrameType.ERROR]  # no reservation for it
            squatters.append(sock)
        try:
            with TcpChannel(rx.address, num_streams=1) as channel:
                transfer, _inbound, _, _ = ship(channel, rx, kit.spec(num_layers=1))
                assert transfer.wait(10) is TransferStatus.COMPLETED, transfer.error
        finally:
            for sock in squatters:
                sock.close()


def test_a_peers_verified_connections_past_its_cap_are_closed_newest_first(kit: Kit) -> None:
    """Plaintext: a peer is its address (every channel here is 127.0.0.1). Three one-stream
    channels prove themselves one after the other; with `max_per_peer` 2 the third's
    connection is closed, the first two keep theirs."""
    limits = ReceiverLimits(max_connections=8, max_unverified=4, max_per_peer=2, handshake_timeout_s=30)
    with TcpReceiver(kit.verifier, limits=limits) as rx, contextlib.ExitStack() as stack:
        channels, sockets = [], []
        for _ in range(3):  # each connects after the last proved itself: accepted (aged) in this order
            channel = stack.enter_context(TcpChannel(rx.address, num_streams=1))
            channels.append(channel)
            transfer, _inbound, _, _ = ship(channel, rx, kit.spec(num_layers=1))
            assert transfer.wait(10) is TransferStatus.COMPLETED, transfer.error
            sockets.append(channel.streams[0].sock)
        deadline = time.monotonic() + 5
        while rx.num_connections > 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert rx.num_connections == 2
        for channel, sock in zip(channels[:2], sockets[:2], strict=True):
            transfer, _inbound, _, _ = ship(channel, rx, kit.spec(num_layers=1))
            assert transfer.wait(10) is TransferStatus.COMPLETED, transfer.error
            assert channel.streams[0].sock is sock  # never closed
