"""Mutual TLS for KV connections: certificates (`prfaas certs init`) and a thread-safe socket.

Both ends present a certificate signed by the deployment's CA and check the other's
(`server_context`, `client_context`; TLS 1.3 only). The sender also checks that the
receiver's certificate names the address it dialled (a DNS name or IP in its SAN).

Each KV connection has a writer thread and a reader thread. An `ssl.SSLSocket` must not
be read and written from two threads at once (one OpenSSL `SSL` object is not safe for
concurrent use), so `TlsSocket` runs the TLS state machine over memory BIOs under a lock
that is never held across socket I/O: writes encrypt under the lock, then send; reads
receive, then decrypt under the lock. Records leave in the order they were made.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import re
import secrets
import socket
import ssl
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar, cast

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from prfaas.transport import sockets
from prfaas.transport.adaptive import LAN_RTT_S
from prfaas.transport.identity import Identity
from prfaas.transport.tls_records import RecordFraming

T = TypeVar("T")
NODE_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}")  # a node's file name in the certificate folder
RECV_BYTES = 1 << 20  # ciphertext moved into the TLS engine per receive (bulk transfer)
HANDSHAKE_RECV_BYTES = 16 << 10  # per receive during the handshake: no peer is known yet
# A receive shorter than this that ends inside a record waits for the record's rest. Over a
# WAN receives are a few packets each and the wait saves a wake-up and a failed decrypt per
# record; on a fast link a large receive's whole records are decrypted at once instead (the
# wait would hold them back while the peer encrypts the next).
WAIT_BELOW = 64 << 10
WRITE_SLICE = 256 << 10  # plaintext encrypted per lock hold: large writes interleave with reads


# ------------------------------------------------------------------ certificates


@dataclass(frozen=True)
class NodeCert:
    """Files a node loads: its certificate and key, and the CA that signs its peers."""

    cert: Path
    key: Path
    ca: Path


def _write_private(path: Path, data: bytes) -> None:
    """`data` into `path`, mode 0600 even where `path` exists with a wider mode (O_CREAT's mode applies only to
    a new file): a file of our own, created 0600, replaces it."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    pem, pkcs8 = serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8
    return key.private_bytes(pem, pkcs8, serialization.NoEncryption())


def _san(names: list[str], identity: Identity | None) -> x509.SubjectAlternativeName:
    entries: list[x509.GeneralName] = []
    if identity is not None:
        entries += [x509.UniformResourceIdentifier(identity.uri), x509.DNSName(identity.server_name)]
    for name in names:
        try:
            entries.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            entries.append(x509.DNSName(name))
    return x509.SubjectAlternativeName(entries)


def init_certs(
    directory: Path,
    names: list[str],
    sans: list[str],
    *,
    identities: Mapping[str, Identity] | None = None,
    days: int = 825,
    force: bool = False,
) -> tuple[Path, list[NodeCert]]:
    """Create the CA in `directory` (kept if present, unless `force`) and a certificate for
    each node name, valid for client and server use, with `sans` (DNS names or IPs) as the
    names peers may dial and, where `identities` names one, the node's identity URI
    (transport/identity.py). Keys are written 0600. Returns (CA path, node certificates)."""
    identities = identities or {}
    unknown = sorted(set(identities) - set(names))
    if unknown:
        raise ValueError(f"identities for nodes not issued: {', '.join(unknown)}")
    if not names:
        raise ValueError("name at least one node")
    if not sans:
        raise ValueError("give at least one DNS name or IP address the node is reached at")
    for name in names:  # all checked before anything is written
        if not NODE_NAME.fullmatch(name) or name in ("ca", "ca-key"):  # "ca": the CA's own files
            raise ValueError(f"bad node name {name!r}: letters, digits, '.', '_', '-', not leading '.'; not ca")
    now = datetime.datetime.now(datetime.UTC)
    try:
        not_after: datetime.datetime | None = now + datetime.timedelta(days=days)
    except OverflowError:  # past year 9999
        not_after = None
    if days < 1 or not_after is None:  # before the CA is written: a bad value must not cost a --force run its CA
        raise ValueError(f"--days {days}: node certificates are valid from 1 day to year 9999")
    directory.mkdir(parents=True, exist_ok=True)
    ca_path, ca_key_path = directory / "ca.pem", directory / "ca-key.pem"
    if force or not ca_path.exists() or not ca_key_path.exists():
        ca_key = ec.generate_private_key(ec.SECP256R1())
        # A name of its own per CA (and key identifiers below): during a rotation peers trust a
        # bundle of the old and the new CA, and OpenSSL picks the issuer by name and key id.
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"prfaas CA {secrets.token_hex(4)}")])
        ca_cert = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(ca_key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=3650))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
            .add_extension(
                x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
            )  # key_cert_sign, crl_sign
            .sign(ca_key, hashes.SHA256())
        )
        _write_private(ca_key_path, _key_pem(ca_key))
        ca_path.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    else:
        loaded = serialization.load_pem_private_key(ca_key_path.read_bytes(), password=None)
        if not isinstance(loaded, ec.EllipticCurvePrivateKey):
            raise ValueError(f"{ca_key_path} is not an EC private key")
        ca_key = loaded
        ca_cert = x509.load_pem_x509_certificate(ca_path.read_bytes())
    nodes = []
    for name in names:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(ca_cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(not_after)
            .add_extension(_san(sans, identities.get(name)), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .add_extension(
                x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                critical=False,
            )
            .sign(ca_key, hashes.SHA256())
        )
        node = NodeCert(directory / f"{name}.pem", directory / f"{name}-key.pem", ca_path)
        _write_private(node.key, _key_pem(key))
        node.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        nodes.append(node)
    return ca_path, nodes


def _context(purpose: ssl._SSLMethod, node: NodeCert) -> ssl.SSLContext:
    context = ssl.SSLContext(purpose)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.verify_mode = ssl.CERT_REQUIRED
    context.load_verify_locations(cafile=str(node.ca))
    context.load_cert_chain(certfile=str(node.cert), keyfile=str(node.key))
    return context


def server_context(node: NodeCert) -> ssl.SSLContext:
    """A receiver's context: requires a client certificate from the CA."""
    return _context(ssl.PROTOCOL_TLS_SERVER, node)


def client_context(node: NodeCert) -> ssl.SSLContext:
    """A sender's context: presents its certificate, checks the receiver's chain and name."""
    context = _context(ssl.PROTOCOL_TLS_CLIENT, node)
    context.check_hostname = True
    return context


# ------------------------------------------------------------------ the socket


_RECEIVE_BUFFERS: list[bytearray] = []  # RECV_BYTES each, lent to a reading thread for one receive


def _borrow() -> bytearray:
    try:
        return _RECEIVE_BUFFERS.pop()  # atomic under the GIL
    except IndexError:
        return bytearray(RECV_BYTES)


class TlsSocket:
    """TLS over a connected socket, safe for one reading and one writing thread at a time.

    Offers what the KV transport uses of a socket: `sendall`, `recv_into`, `settimeout`,
    `getsockopt`, `setsockopt`, `shutdown`, `close`. Blocking, bounded by the socket's timeout.
    """

    def __init__(self, sock: socket.socket, tls: ssl.SSLObject, incoming: ssl.MemoryBIO, outgoing: ssl.MemoryBIO):
        self._sock = sock
        self._tls = tls
        self._in = incoming
        self._out = outgoing
        self._tls_lock = threading.Lock()  # the SSLObject and its BIOs
        self._send_lock = threading.Lock()  # the order of records on the socket
        self._records = RecordFraming()  # where the received ciphertext's records end

    @classmethod
    def wrap(
        cls,
        sock: socket.socket,
        context: ssl.SSLContext,
        *,
        server_side: bool,
        server_hostname: str | None = None,
        timeout_s: float,
    ) -> TlsSocket:
        """Run the handshake within `timeout_s` (socket.timeout / ssl.SSLError / ConnectionError
        on failure; the caller closes `sock`). The socket is left blocking without a timeout."""
        incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        tls = context.wrap_bio(incoming, outgoing, server_side=server_side, server_hostname=server_hostname)
        self = cls(sock, tls, incoming, outgoing)
        deadline = time.monotonic() + timeout_s  # for the whole handshake, however the peer trickles
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"TLS handshake not done within {timeout_s} s")
            sock.settimeout(remaining)
            try:
                self._locked(tls.do_handshake)
                break
            except ssl.SSLWantReadError:
                data = sock.recv(HANDSHAKE_RECV_BYTES)
                if not data:
                    raise ConnectionError("peer closed the connection during the TLS handshake") from None
                with self._tls_lock:
                    incoming.write(data)
        sock.settimeout(None)
        path = sockets.tcp_info(sock)
        if path is not None and path.min_rtt_s < LAN_RTT_S:  # a fast path: receives are large
            self._records.valid = False
        with self._tls_lock:  # what came after the handshake starts on a record boundary
            rest = incoming.read()
            incoming.write(rest)
        self._records.advance(memoryview(rest))
        return self

    def _locked(self, operation: Callable[[], T]) -> T:
        """Run a TLS operation under the lock, then send whatever records it made, in order.
        The send lock is taken before the TLS lock is let go, so records leave in the order
        they were made; no lock is held while waiting to receive."""
        error: BaseException | None = None
        result: T | None = None
        with self._tls_lock:
            try:
                result = operation()
            except BaseException as exc:  # WantRead during a handshake still has records to send
                error = exc
            data = self._out.read()
            if data:
                self._send_lock.acquire()
        if data:
            try:
                self._sock.sendall(data)
            finally:
                self._send_lock.release()
        if error is not None:
            raise error
        return result  # type: ignore[return-value]

    def _receive(self) -> bool:
        """Move what the socket has (up to RECV_BYTES) into the TLS engine; False at EOF.

        Waits for data holding no buffer (a peek), then receives into a buffer borrowed from a
        small pool: large receives make the reader decrypt in large batches (1 MiB instead of
        256 KiB cut its CPU per GB by a sixth on loopback), and idle connections, of which a
        receiver has hundreds, hold no megabyte each."""
        if not self._sock.recv(1, socket.MSG_PEEK):
            return False
        buffer = _borrow()
        try:
            n = self._sock.recv_into(buffer, RECV_BYTES)  # data is waiting: returns at once
            missing = self._records.advance(memoryview(buffer)[:n])
            if missing > 0 and n < WAIT_BELOW:  # a few packets in: one wake-up for the record's rest
                more = self._sock.recv_into(memoryview(buffer)[n:], missing, socket.MSG_WAITALL)
                self._records.advance(memoryview(buffer)[n : n + more])
                n += more
            if n:
                with self._tls_lock:
                    self._in.write(memoryview(buffer)[:n])
        finally:
            if len(_RECEIVE_BUFFERS) < 8:  # a few kept for reuse; more readers at once allocate
                _RECEIVE_BUFFERS.append(buffer)
        return n > 0

    def sendall(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data).cast("B")
        for offset in range(0, len(view), WRITE_SLICE):
            piece = view[offset : offset + WRITE_SLICE]
            self._locked(lambda piece=piece: self._tls.write(piece))  # type: ignore[misc]

    def recv_into(self, buffer: memoryview, nbytes: int = 0) -> int:
        """Up to `nbytes` (or len(buffer)) decrypted bytes into `buffer`; 0 when the peer closed.
        Decrypts every whole record already received in one hold of the lock (a record is at
        most 16 KiB: one lock and call per record cost the reader a third of its CPU)."""
        view = memoryview(buffer).cast("B")
        view = view[: nbytes or len(view)]
        timeout = self._sock.gettimeout()  # for this whole call, not for each raw recv under it: a peer
        deadline = time.monotonic() + timeout if timeout else None  # trickling a record cannot stretch it
        while True:
            try:
                got = self._locked(lambda: self._decrypt_into(view))
            except ssl.SSLZeroReturnError:
                return 0
            if got:
                return got
            if deadline is None:
                if not self._receive():
                    return 0
                continue
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("timed out waiting for a whole TLS record")
            self._sock.settimeout(left)
            try:
                received = self._receive()
            finally:
                self._sock.settimeout(timeout)
            if not received:
                return 0

    def _decrypt_into(self, view: memoryview) -> int:
        """Under the lock: records into `view` until it is full or no whole record is left;
        0 when none was (receive more)."""
        read_into = cast(Callable[[int, memoryview], int], self._tls.read)  # with a buffer: a count
        got = 0
        while got < len(view):
            try:
                n = read_into(len(view) - got, view[got:])
            except ssl.SSLWantReadError:
                return got
            except ssl.SSLZeroReturnError:
                if got:
                    return got
                raise
            got += n
        return got

    def peer_certificate(self) -> bytes | None:
        """The peer's certificate (DER), as verified by the handshake; None if it sent none."""
        return self._tls.getpeercert(binary_form=True)

    def settimeout(self, timeout_s: float | None) -> None:
        self._sock.settimeout(timeout_s)

    def getsockopt(self, level: int, option: int, buflen: int) -> bytes:
        return self._sock.getsockopt(level, option, buflen)

    def setsockopt(self, level: int, option: int, value: int | bytes) -> None:
        self._sock.setsockopt(level, option, value)

    def shutdown(self, how: int) -> None:
        self._sock.shutdown(how)

    def close(self) -> None:
        self._sock.close()
