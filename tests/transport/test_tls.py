"""Mutual TLS on KV connections: certificates from `prfaas certs init`, real sockets."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from transport_kit import Kit, fill, layers_for, ship

from prfaas.transport.api import Shipment, TransferStatus
from prfaas.transport.errors import PeerUnavailable
from prfaas.transport.framing import Frame, FrameType, encode, json_payload
from prfaas.transport.tcp_receiver import TcpReceiver
from prfaas.transport.tcp_sender import TcpChannel
from prfaas.transport.tls import NodeCert, client_context, init_certs, server_context


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, NodeCert]:
    directory = tmp_path_factory.mktemp("certs")
    _ca, nodes = init_certs(directory, ["decode", "prefill"], ["127.0.0.1", "localhost"])
    _other_ca, (stranger,) = init_certs(directory / "other", ["stranger"], ["127.0.0.1"])
    return {"decode": nodes[0], "prefill": nodes[1], "stranger": stranger}


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
    bad = run("--name", "../escape")
    assert bad.returncode == 2 and "bad node name" in bad.stdout


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
