"""Mutual TLS on KV connections: certificates from `prfaas certs init`, real sockets."""

from __future__ import annotations

import contextlib
import os
import socket
import ssl
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from transport_kit import Kit, fill, layers_for, ship

from prfaas.transport.admission import ReceiverLimits
from prfaas.transport.api import Shipment, TransferStatus
from prfaas.transport.errors import PeerUnavailable
from prfaas.transport.framing import ErrorCode, Frame, FrameType, encode, json_payload, read_frame
from prfaas.transport.identity import Identity, server_name
from prfaas.transport.outbound import OutboundTransfer
from prfaas.transport.tcp_receiver import TcpReceiver
from prfaas.transport.tcp_sender import TcpChannel
from prfaas.transport.tls import NodeCert, TlsSocket, client_context, init_certs, server_context
from prfaas.transport.tls_records import RecordFraming


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, NodeCert]:
    """Certificates of one CA: a decode and a prefill region (with their identities), a node
    without an identity, a decode region reached only by its server name (no loopback SAN);
    and one from another CA."""
    directory = tmp_path_factory.mktemp("certs")
    identities = {"decode": Identity("decode", "decode-a", "*"), "prefill": Identity("prefill", "prefill-a", "1"),
                  "both": Identity("both", "local", "1")}  # fmt: skip
    _ca, nodes = init_certs(directory, [*identities, "anonymous"], ["127.0.0.1", "localhost"], identities=identities)
    named = {"named": Identity("decode", "decode-b", "*")}
    _ca, (by_name,) = init_certs(directory, ["named"], ["10.255.0.1"], identities=named)
    _other_ca, (stranger,) = init_certs(directory / "other", ["stranger"], ["127.0.0.1"])
    return {**dict(zip([*identities, "anonymous"], nodes, strict=True)), "named": by_name, "stranger": stranger}


def test_certs_init_cli_keeps_the_ca_and_writes_private_keys_0600(tmp_path: Path) -> None:
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "prfaas.cli.main", "certs", "init", "--dir", str(tmp_path), *args]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)

    first = run("--name", "region-a", "--san", "10.0.0.5")
    assert first.returncode == 0, first.stderr
    assert "CA created" in first.stdout
    ca = (tmp_path / "ca.pem").read_bytes()
    second = run("--name", "region-b")
    assert second.returncode == 0, second.stderr
    assert "CA kept" in second.stdout
    assert (tmp_path / "ca.pem").read_bytes() == ca  # region-b is signed by the same CA
    for key in ("ca-key.pem", "region-a-key.pem", "region-b-key.pem"):
        assert stat.S_IMODE(os.stat(tmp_path / key).st_mode) == 0o600
    for name in ("../escape", "ca", "ca-key", ".hidden"):  # "ca": its files are the CA's (its key overwritten)
        bad = run("--name", "region-c", "--name", name)
        assert bad.returncode == 2 and "bad node name" in bad.stdout
        assert not (tmp_path / "region-c.pem").exists()  # every name is checked before anything is written
    assert (tmp_path / "ca.pem").read_bytes() == ca


def test_certs_init_tightens_key_files_that_exist_with_a_wider_mode_to_0600(tmp_path: Path) -> None:
    """O_CREAT's 0600 applies only to a new file: a key written into an existing 0644 file stayed readable
    by all, while the command printed 0600."""
    for key in ("ca-key.pem", "node-key.pem"):
        (tmp_path / key).write_text("old")
        (tmp_path / key).chmod(0o644)
    _ca, (node,) = init_certs(tmp_path, ["node"], ["127.0.0.1"], force=True)
    for key in (tmp_path / "ca-key.pem", node.key):
        assert stat.S_IMODE(os.stat(key).st_mode) == 0o600 and b"PRIVATE KEY" in key.read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ca-key.pem", "ca.pem", "node-key.pem", "node.pem"]


@pytest.mark.parametrize("days", [0, -1, 10**9])
def test_certs_init_refuses_days_that_are_no_validity_before_writing_anything(tmp_path: Path, days: int) -> None:
    """--days 0 issued a certificate already expired (exit 0); -1 with --force replaced the CA, then failed."""
    _ca, _nodes = init_certs(tmp_path, ["node"], ["127.0.0.1"])
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    cmd = [sys.executable, "-m", "prfaas.cli.main", "certs", "init", "--dir", str(tmp_path), "--name", "other",
           "--force", "--days", str(days)]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 2 and "--days" in out.stdout + out.stderr, out.stdout + out.stderr
    assert "Traceback" not in out.stdout + out.stderr
    with pytest.raises(ValueError, match=f"--days {days}: node certificates are valid from 1 day"):
        init_certs(tmp_path, ["other"], ["127.0.0.1"], days=days, force=True)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # the CA kept, nothing issued


@pytest.mark.parametrize("codec", ["raw", "lossless"])
def test_shipment_over_mutual_tls_reassembles_bit_exactly(kit: Kit, certs: dict[str, NodeCert], codec: str) -> None:
    with (
        TcpReceiver(kit.verifier, ssl_context=server_context(certs["decode"])) as rx,
        TcpChannel(rx.address, num_streams=4, ssl_context=client_context(certs["prefill"])) as channel,
    ):
        transfer, inbound, layers, _ = ship(channel, rx, kit.spec(codec=codec, num_layers=8))
        assert transfer.wait(15) is TransferStatus.COMPLETED, transfer.error
        assert inbound.wait(5) is TransferStatus.COMPLETED
        for index, pair in enumerate(layers):
            assert inbound.layer(index, 1) == pair
        assert isinstance(transfer, OutboundTransfer) and not transfer.checksum_payload  # TLS authenticates it


@pytest.mark.parametrize("client", ["stranger", None])
def test_a_sender_without_a_certificate_from_the_ca_is_refused(
    kit: Kit, certs: dict[str, NodeCert], client: str | None
) -> None:
    """A certificate from another CA, or none at all (plain TCP): no connection comes up, the
    transfer fails within the channel's unavailable window, and nothing is stored."""
    with TcpReceiver(kit.verifier, ssl_context=server_context(certs["decode"])) as rx:
        context = client_context(certs[client]) if client else None
        with TcpChannel(rx.address, num_streams=2, ssl_context=context, unavailable_after_s=1.0) as channel:
            start = time.monotonic()
            transfer, inbound, _, _ = ship(channel, rx, kit.spec(num_layers=2), expect_timeout_s=10)
            assert transfer.wait(8) is TransferStatus.FAILED
            assert isinstance(transfer.error, PeerUnavailable)
            assert time.monotonic() - start < 8
            assert inbound.info is None and inbound.wire_bytes == 0


def test_a_receiver_with_a_certificate_from_another_ca_is_refused(kit: Kit, certs: dict[str, NodeCert]) -> None:
    with (
        TcpReceiver(kit.verifier, ssl_context=server_context(certs["stranger"])) as rx,
        TcpChannel(
            rx.address, num_streams=1, ssl_context=client_context(certs["prefill"]), unavailable_after_s=1.0
        ) as channel,
    ):
        shipment = Shipment(kit.spec(num_layers=1))
        transfer = channel.submit(shipment)
        fill(shipment, layers_for(shipment.spec))
        assert transfer.wait(8) is TransferStatus.FAILED
        assert isinstance(transfer.error, PeerUnavailable)


def test_a_stalled_handshake_does_not_hold_up_other_senders(kit: Kit, certs: dict[str, NodeCert]) -> None:
    """A client that connects and says nothing ties up only its own connection thread."""
    with TcpReceiver(kit.verifier, ssl_context=server_context(certs["decode"])) as rx:
        silent = socket.create_connection(rx.address)
        try:
            with TcpChannel(rx.address, num_streams=1, ssl_context=client_context(certs["prefill"])) as channel:
                transfer, inbound, _, _ = ship(channel, rx, kit.spec(num_layers=2), expect_timeout_s=10)
                assert transfer.wait(5) is TransferStatus.COMPLETED, transfer.error
                assert inbound.wait(2) is TransferStatus.COMPLETED
        finally:
            silent.close()


def test_plaintext_frames_to_a_tls_receiver_get_no_reply(kit: Kit, certs: dict[str, NodeCert]) -> None:
    with TcpReceiver(kit.verifier, ssl_context=server_context(certs["decode"])) as rx:
        sock = socket.create_connection(rx.address, timeout=5)
        try:
            sock.sendall(encode(Frame(FrameType.HELLO, payload=json_payload({"versions": [1], "node": "x"}))))
            assert sock.recv(64) == b""  # the receiver closes: no HELLO_OK, nothing parsed as KV
        except ConnectionResetError:
            pass
        finally:
            sock.close()


@pytest.mark.parametrize("client", ["decode", "anonymous"])
def test_a_sender_whose_certificate_serves_no_prefill_is_refused(
    kit: Kit, certs: dict[str, NodeCert], client: str
) -> None:
    """A decode region's certificate, or one that names no identity (both from the right CA):
    the receiver answers HELLO with ERROR PEER_REFUSED and closes; no shipment opens."""
    with TcpReceiver(kit.verifier, ssl_context=server_context(certs["decode"])) as rx:
        sock = socket.create_connection(rx.address, timeout=5)
        tls = TlsSocket.wrap(sock, client_context(certs[client]), server_side=False, server_hostname="127.0.0.1",
                             timeout_s=5)  # fmt: skip
        try:
            tls.settimeout(5)
            tls.sendall(encode(Frame(FrameType.HELLO, payload=json_payload({"versions": [1], "node": "x"}))))
            reply, _ok = read_frame(tls)
            assert reply.type is FrameType.ERROR and reply.json()["code"] == ErrorCode.PEER_REFUSED
            assert "accepts prefill regions only" in reply.json()["message"]
            assert tls.recv_into(memoryview(bytearray(64))) == 0  # then closed
        finally:
            sock.close()
        with TcpChannel(rx.address, num_streams=1, ssl_context=client_context(certs[client]),
                        unavailable_after_s=1.0) as channel:  # fmt: skip
            transfer, inbound, _, _ = ship(channel, rx, kit.spec(num_layers=2), expect_timeout_s=10)
            assert transfer.wait(8) is TransferStatus.FAILED
            assert isinstance(transfer.error, PeerUnavailable) and "PEER_REFUSED" in str(transfer.error)
            assert inbound.info is None and inbound.wire_bytes == 0


def test_a_region_serving_both_roles_may_send(kit: Kit, certs: dict[str, NodeCert]) -> None:
    with (
        TcpReceiver(kit.verifier, ssl_context=server_context(certs["decode"])) as rx,
        TcpChannel(rx.address, num_streams=1, ssl_context=client_context(certs["both"])) as channel,
    ):
        transfer, _inbound, _, _ = ship(channel, rx, kit.spec(num_layers=2))
        assert transfer.wait(10) is TransferStatus.COMPLETED, transfer.error


def test_over_tls_a_peer_is_the_identity_its_certificate_names(kit: Kit, certs: dict[str, NodeCert]) -> None:
    """`max_per_peer` 1, every sender on 127.0.0.1: one connection each for two identities
    stays; a second connection of the same identity is closed."""
    limits = ReceiverLimits(max_per_peer=1, handshake_timeout_s=30)
    with (
        TcpReceiver(kit.verifier, ssl_context=server_context(certs["decode"]), limits=limits) as rx,
        contextlib.ExitStack() as stack,
    ):
        senders = ["prefill", "both", "prefill"]
        channels = [stack.enter_context(TcpChannel(rx.address, num_streams=1, ssl_context=client_context(certs[name])))
                    for name in senders]  # fmt: skip
        for channel in channels:
            transfer, _inbound, _, _ = ship(channel, rx, kit.spec(num_layers=1))
            assert transfer.wait(10) is TransferStatus.COMPLETED, transfer.error
        deadline = time.monotonic() + 5
        while rx.num_connections > 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert rx.num_connections == 2
        sockets = [channel.streams[0].sock for channel in channels[:2]]
        for channel, sock in zip(channels[:2], sockets, strict=True):
            transfer, _inbound, _, _ = ship(channel, rx, kit.spec(num_layers=1))
            assert transfer.wait(10) is TransferStatus.COMPLETED, transfer.error
            assert channel.streams[0].sock is sock


@pytest.mark.parametrize(("hostname", "ok"), [(server_name("decode-b"), True), (None, False),
                                              (server_name("decode-a"), False)])  # fmt: skip
def test_the_sender_checks_the_regions_server_name_instead_of_the_dialled_address(
    kit: Kit, certs: dict[str, NodeCert], hostname: str | None, ok: bool
) -> None:
    """The receiver's certificate names decode-b.region.prfaas and 10.255.0.1, not the loopback
    address dialled: with `server_hostname` the name is what counts; without it, the dialled
    address, which it does not name; another region's name does not do either."""
    with (
        TcpReceiver(kit.verifier, ssl_context=server_context(certs["named"])) as rx,
        TcpChannel(
            rx.address,
            num_streams=1,
            ssl_context=client_context(certs["prefill"]),
            server_hostname=hostname,
            unavailable_after_s=1.0,
        ) as channel,  # fmt: skip
    ):
        transfer, _inbound, _, _ = ship(channel, rx, kit.spec(num_layers=2), expect_timeout_s=10)
        status = transfer.wait(8)
        if ok:
            assert status is TransferStatus.COMPLETED, transfer.error
        else:
            assert status is TransferStatus.FAILED and isinstance(transfer.error, PeerUnavailable)
            assert "certificate verify failed" in str(transfer.error) or "match" in str(transfer.error)


def test_a_tls_handshake_that_stalls_is_closed_at_the_handshake_deadline(kit: Kit, certs: dict[str, NodeCert]) -> None:
    limits = ReceiverLimits(handshake_timeout_s=0.5)
    with TcpReceiver(kit.verifier, ssl_context=server_context(certs["decode"]), limits=limits) as rx:
        sock = socket.create_connection(rx.address, timeout=5)
        context = client_context(certs["prefill"])
        tls = context.wrap_bio(ssl.MemoryBIO(), outgoing := ssl.MemoryBIO(), server_hostname="127.0.0.1")
        with contextlib.suppress(ssl.SSLWantReadError):
            tls.do_handshake()
        try:
            sock.sendall(outgoing.read())  # the ClientHello, then nothing more
            start = time.monotonic()
            while sock.recv(65536):  # the server's first flight, then EOF
                pass
            assert 0.3 < time.monotonic() - start < 2.0
        finally:
            sock.close()


def test_a_bundle_of_the_old_and_the_new_ca_trusts_both_during_a_rotation(kit: Kit, tmp_path: Path) -> None:
    """CA rotation without downtime: every node trusts old + new CA for a while; certificates of
    either then verify (each CA has a name and key identifier of its own)."""
    _old_ca, (old,) = init_certs(tmp_path / "old", ["decode"], ["127.0.0.1"])
    prefill = {"prefill": Identity.parse("prfaas://prefill/pre-a/1")}  # a KV receiver takes prefill peers only
    _new_ca, (new,) = init_certs(tmp_path / "new", ["prefill"], ["127.0.0.1"], identities=prefill)
    bundle = tmp_path / "bundle.pem"
    bundle.write_bytes(old.ca.read_bytes() + new.ca.read_bytes())
    with (
        TcpReceiver(kit.verifier, ssl_context=server_context(NodeCert(old.cert, old.key, bundle))) as rx,
        TcpChannel(rx.address, ssl_context=client_context(NodeCert(new.cert, new.key, bundle))) as channel,
    ):
        transfer, inbound, _layers, _ = ship(channel, rx, kit.spec(num_layers=2))
        assert transfer.wait(15) is TransferStatus.COMPLETED, transfer.error
        assert inbound.wait(5) is TransferStatus.COMPLETED


def _record(kind: int, body: bytes) -> bytes:
    return bytes([kind, 3, 3]) + len(body).to_bytes(2, "big") + body


@pytest.mark.parametrize("cut", [1, 3, 5, 6, 100, 16389])
def test_record_framing_says_what_the_record_a_receive_stops_in_still_lacks(cut: int) -> None:
    stream = _record(23, b"a" * 16384) + _record(23, b"b" * 100)
    framing = RecordFraming()
    missing = framing.advance(memoryview(stream[:cut]))
    first = 5 + 16384
    if cut < 5:  # in the header: the rest of it (the body's length is not known yet)
        assert missing == 5 - cut
    else:
        assert missing == (first - cut if cut < first else 0 if cut == first else first + 105 - cut)
    assert framing.advance(memoryview(stream[cut:])) == 0  # the stream ends on a boundary


def test_anything_not_a_tls_13_record_turns_the_waiting_off_for_good() -> None:
    framing = RecordFraming()
    assert framing.advance(memoryview(b"\x17\x03\x01\x00\x10" + b"x" * 4)) == 0  # legacy version 0x0301
    assert not framing.valid
    assert framing.advance(memoryview(_record(23, b"y" * 10)[:7])) == 0  # never waits again


def test_a_reader_waiting_for_the_rest_of_records_over_a_trickling_link_gets_every_byte(
    certs: dict[str, NodeCert],
) -> None:
    """The wait for a record's rest (on over a WAN; forced on here, loopback turns it off): a
    link that delivers 1,000 bytes at a time, and a peer that closes mid-record, neither lose
    bytes nor hang the reader."""
    listener = socket.create_server(("127.0.0.1", 0))
    relay = socket.create_server(("127.0.0.1", 0))

    def trickle() -> None:  # relay -> listener, 1,000 bytes per write, 1 ms apart
        inbound, _ = relay.accept()
        with inbound, socket.create_connection(listener.getsockname()) as outbound:
            pump = threading.Thread(target=lambda: _copy(outbound, inbound), daemon=True)
            pump.start()  # the other direction (the handshake's replies) at full speed
            with contextlib.suppress(OSError):
                while data := inbound.recv(1000):
                    outbound.sendall(data)
                    time.sleep(0.001)
            outbound.shutdown(socket.SHUT_RDWR)  # an end of stream the reader sees (and the pump)
            pump.join(5)

    threading.Thread(target=trickle, daemon=True).start()
    client = socket.create_connection(relay.getsockname())
    server_sock, _ = listener.accept()
    wrapped: list[TlsSocket] = []
    server = threading.Thread(target=lambda: wrapped.append(TlsSocket.wrap(
        server_sock, server_context(certs["decode"]), server_side=True, timeout_s=10)))  # fmt: skip
    server.start()
    sender = TlsSocket.wrap(client, client_context(certs["prefill"]), server_side=False,
                            server_hostname="127.0.0.1", timeout_s=10)  # fmt: skip
    server.join(10)
    (reader,) = wrapped
    reader._records = RecordFraming()  # at a record boundary: nothing sent yet
    payload = os.urandom(200_000)
    sender.sendall(payload)
    client.sendall(b"\x17\x03\x03\x40\x11" + b"x" * 100)  # the start of a 16,401-byte record ...
    client.shutdown(socket.SHUT_WR)  # ... that never ends
    received = bytearray()
    buffer = bytearray(1 << 16)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and (n := reader.recv_into(memoryview(buffer))):
        received += buffer[:n]
    assert bytes(received) == payload
    assert time.monotonic() < deadline
    assert reader._records.valid  # framed the whole way, never gave up
    reader.close()
    sender.close()
    listener.close()
    relay.close()


def _copy(source: socket.socket, sink: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while data := source.recv(1 << 16):
            sink.sendall(data)


def test_a_receiver_trickling_its_tls_hello_reply_cannot_stretch_the_handshake(certs: dict[str, NodeCert]) -> None:
    """Over TLS one read of HELLO_OK waits for a whole record, and each raw recv under it took the full timeout
    again: a receiver sending its record a byte every 0.3 s held the setup for the record's length x 0.3 s.
    The setup's one deadline (connect_timeout_s) holds under TLS too."""
    listener = socket.create_server(("127.0.0.1", 0))
    ended: list[float] = []
    stop = threading.Event()

    def serve() -> None:
        raw, _ = listener.accept()
        incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        tls = server_context(certs["decode"]).wrap_bio(incoming, outgoing, server_side=True)
        started = time.monotonic()
        with contextlib.suppress(OSError), raw:
            while True:  # the handshake, pumped by hand
                try:
                    tls.do_handshake()
                    break
                except ssl.SSLWantReadError:
                    raw.sendall(outgoing.read())
                    incoming.write(raw.recv(65536))
            raw.sendall(outgoing.read())
            tls.write(encode(Frame(FrameType.HELLO_OK, payload=json_payload({"version": 1, "node": "slow"}))))
            record = outgoing.read()
            raw.settimeout(0.3)
            for byte in record:  # the HELLO_OK record, one byte every 0.3 s, until the client gives up
                if stop.is_set():
                    return
                raw.sendall(bytes([byte]))
                with contextlib.suppress(TimeoutError):
                    if raw.recv(65536) == b"":
                        break  # the client closed the connection
            ended.append(time.monotonic() - started)

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    channel = TcpChannel(listener.getsockname()[:2], num_streams=1, ssl_context=client_context(certs["prefill"]),
                         connect_timeout_s=1.5, unavailable_after_s=30)  # fmt: skip
    try:
        server.join(10)
        assert ended and ended[0] < 3, ended
    finally:
        stop.set()
        channel.close(timeout_s=1)
        listener.close()
