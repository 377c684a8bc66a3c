"""gRPC plumbing both ends of a region's calls use (the regions, and the control plane that
calls them and serves their registry): mutual TLS material and credentials, channel and
server options, what a heartbeat carries at most, and reading a stream with a bounded wait."""

from __future__ import annotations

import datetime
import logging
import os
import queue
import tempfile
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
from cryptography import x509
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from prfaas.transport.identity import Identity, identity_of
from prfaas.transport.tls import NodeCert

log = logging.getLogger(__name__)
PEM_PREFIX = "-----BEGIN"


class TlsFiles(BaseModel):
    """A node's mutual-TLS material from `prfaas certs init`: the deployment's CA, the node's
    certificate (naming its identity, transport/identity.py) and its key. Each is a file path,
    or the PEM text itself (from a secret store). Checked when loaded, so that a process exits at
    start rather than failing every handshake later: the CA bundle holds certificates, the
    certificate names exactly one prfaas identity, is valid now and was issued by one of them
    (directly, or through intermediates that follow it in its file), and the key is its key."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    ca: str
    cert: str
    key: str = Field(repr=False)

    def pem(self, which: str) -> bytes:
        try:
            return _read_pem(getattr(self, which))
        except ValueError as exc:
            raise ValueError(f"{which}: {exc}") from None

    @field_validator("ca")
    @classmethod
    def _ca(cls, value: str) -> str:
        _certificates(value)
        return value

    @field_validator("cert")
    @classmethod
    def _cert(cls, value: str, info: ValidationInfo) -> str:
        leaf, *chain = _certificates(value)
        if identity_of(leaf) is None:
            raise ValueError("names no prfaas identity (issue it with `prfaas certs init --identity ...`)")
        now = datetime.datetime.now(datetime.UTC)
        if not leaf.not_valid_before_utc <= now <= leaf.not_valid_after_utc:
            raise ValueError(f"valid from {leaf.not_valid_before_utc:%Y-%m-%d %H:%M} to "
                             f"{leaf.not_valid_after_utc:%Y-%m-%d %H:%M} UTC, not now")  # fmt: skip
        if "ca" in info.data and not _issued_by(leaf, chain, _certificates(info.data["ca"])):
            raise ValueError("not issued by a CA in tls.ca (a certificate from another deployment's CA?)")
        return value

    @field_validator("key")
    @classmethod
    def _key(cls, value: str, info: ValidationInfo) -> str:
        pem = _read_pem(value)
        try:
            key = serialization.load_pem_private_key(pem, password=None)
        except (TypeError, ValueError, UnsupportedAlgorithm):  # TypeError: a key that needs a password
            raise ValueError("not an unencrypted PEM private key") from None
        if "cert" in info.data and _spki(key.public_key()) != _spki(_certificates(info.data["cert"])[0].public_key()):
            raise ValueError("not the key of tls.cert (its public key differs: another certificate's key?)")
        return value

    @property
    def identity(self) -> Identity:
        identity = identity_of_pem(self.pem("cert"))
        assert identity is not None  # checked when loaded
        return identity

    def node_cert(self) -> NodeCert:
        """The files the KV transport's TLS contexts load (PEM text is written to a private
        temporary folder first: Python's ssl module reads files only)."""
        paths = {}
        folder: Path | None = None
        for which in ("ca", "cert", "key"):
            value: str = getattr(self, which)
            if not value.lstrip().startswith(PEM_PREFIX):
                paths[which] = Path(value).expanduser()
                continue
            folder = folder or Path(tempfile.mkdtemp(prefix="prfaas-tls-"))
            paths[which] = folder / f"{which}.pem"
            fd = os.open(paths[which], os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as out:
                out.write(value)
        return NodeCert(cert=paths["cert"], key=paths["key"], ca=paths["ca"])

    def server_credentials(self) -> grpc.ServerCredentials:
        """A server that requires a client certificate from the deployment's CA."""
        return grpc.ssl_server_credentials(
            [(self.pem("key"), self.pem("cert"))], root_certificates=self.pem("ca"), require_client_auth=True
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(self.pem("ca"), self.pem("key"), self.pem("cert"))


def channel(
    target: str, tls: TlsFiles | None, server_name: str, options: Sequence[tuple[str, Any]] = ()
) -> grpc.Channel:
    """A channel to `target`: with `tls`, mutual TLS checking that the server's certificate
    names `server_name` (transport.identity.server_name: the peer's region, or the control
    plane) whatever address `target` dials; without, plaintext."""
    if tls is None:
        return grpc.insecure_channel(target, options=list(options))
    named = [*options, ("grpc.ssl_target_name_override", server_name)]
    return grpc.secure_channel(target, tls.channel_credentials(), options=named)


def aio_channel(
    target: str, tls: TlsFiles | None, server_name: str, options: Sequence[tuple[str, Any]] = ()
) -> grpc.aio.Channel:
    """`channel`'s asyncio twin (create it on the event loop that will use it)."""
    if tls is None:
        return grpc.aio.insecure_channel(target, options=list(options))
    named = [*options, ("grpc.ssl_target_name_override", server_name)]
    return grpc.aio.secure_channel(target, tls.channel_credentials(), options=named)


class ChannelCache:
    """Channels kept for the process's life, one per (target, server name); thread-safe."""

    def __init__(self, tls: TlsFiles | None, options: Sequence[tuple[str, Any]] = ()) -> None:
        self.tls = tls
        self.options = tuple(options)
        self._lock = threading.Lock()
        self._channels: dict[tuple[str, str], grpc.Channel] = {}

    def get(self, target: str, server_name: str) -> grpc.Channel:
        with self._lock:
            found = self._channels.get((target, server_name))
            if found is None:
                found = self._channels[(target, server_name)] = channel(target, self.tls, server_name, self.options)
            return found


def _read_pem(value: str) -> bytes:
    """A `TlsFiles` field's PEM: the text itself, or the file it names."""
    if value.lstrip().startswith(PEM_PREFIX):
        return value.encode()
    try:
        return Path(value).expanduser().read_bytes()
    except OSError as exc:
        raise ValueError(f"cannot read {value}: {exc.strerror}") from None


def _certificates(value: str) -> list[x509.Certificate]:
    pem = _read_pem(value)
    try:
        return x509.load_pem_x509_certificates(pem)
    except ValueError:
        raise ValueError("holds no PEM certificate") from None


def _spki(key: Any) -> bytes:
    return bytes(key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo))


def _signed_by(cert: x509.Certificate, issuer: x509.Certificate) -> bool:
    try:
        cert.verify_directly_issued_by(issuer)
    except (ValueError, TypeError, InvalidSignature):  # another issuer's name, key type, or signature
        return False
    return True


def _issued_by(leaf: x509.Certificate, chain: list[x509.Certificate], cas: list[x509.Certificate]) -> bool:
    """`leaf` was signed by one of `cas`, directly or through the intermediates of `chain`."""
    cert: x509.Certificate | None = leaf
    for _ in range(len(chain) + 1):
        if cert is None:
            return False
        if any(_signed_by(cert, ca) for ca in cas):
            return True
        cert = next((c for c in chain if _signed_by(cert, c)), None)
    return False


def identity_of_pem(pem: bytes) -> Identity | None:
    try:
        return identity_of(pem)
    except ValueError:  # not a certificate at all
        return None


CONNECT_TIMEOUT_FLOOR_MS = 2000  # a loaded host's loopback handshake must never count as a dead peer


def replies(call: Any, grace_s: float = 5.0) -> Iterator[Any]:
    """A server-streaming call's replies, read on a thread of their own, so that the caller
    never waits in `next()` past the call's end: the iterator of a call that has ended can
    wait forever (grpc/grpc#20562; seen here 1-4 times in 500 stops of a region while a
    call to it connects: the call ended UNAVAILABLE and `next()` never returned). When the
    call has ended and its reader is still stuck `grace_s` later, the replies end there.
    Raises the call (a `grpc.RpcError`) if it ended with a status other than OK; closing the
    generator early cancels the call. The call's own deadline bounds the wait."""
    inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
    call.add_done_callback(lambda _call: inbox.put(("done", None)))  # on gRPC's thread: only signal

    def read() -> None:
        try:
            for reply in call:
                inbox.put(("reply", reply))
        except grpc.RpcError:
            pass
        inbox.put(("end", None))

    threading.Thread(target=read, name="prfaas-rpc-read", daemon=True).start()
    done = False
    try:
        while True:
            try:
                kind, reply = inbox.get(timeout=grace_s if done else None)
            except queue.Empty:
                log.warning("a stream's reader is stuck %.0f s after its call ended (grpc#20562)", grace_s)
                break
            if kind == "reply":
                yield reply
            elif kind == "done":
                done = True
            else:
                break
    finally:
        call.cancel()  # no-op once it ended
    if call.code() != grpc.StatusCode.OK:
        raise call


def keepalive_options(interval_s: float) -> list[tuple[str, int]]:
    """Client channel options: a peer that vanishes without closing its connection (power
    loss, partition) is noticed within an interval plus max(2 s, an interval) (a ping each
    interval, its ack awaited that long); one that takes the TCP connection but never answers
    the HTTP/2 handshake (hung, or stopping) fails a call's connect in max(2 s, two intervals)
    instead of gRPC's default 20 s. Pass `grpc.min_reconnect_backoff_ms` no second time: the
    first of a repeated option wins."""
    interval_ms = max(100, int(interval_s * 1000))
    ack_ms = max(CONNECT_TIMEOUT_FLOOR_MS, interval_ms)  # a loaded host's late ack is no dead peer either
    return [
        ("grpc.min_reconnect_backoff_ms", max(CONNECT_TIMEOUT_FLOOR_MS, 2 * interval_ms)),  # the connect timeout
        ("grpc.keepalive_time_ms", interval_ms),
        ("grpc.keepalive_timeout_ms", ack_ms),
        # what grpcio (1.85) waits for any ping's ack before it closes the connection: without it an
        # unanswered keepalive ping waits its default 60 s, whatever keepalive_timeout_ms says
        ("grpc.http2.ping_timeout_ms", ack_ms),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]


# Prefix blocks one heartbeat carries at most (registry.proto Load.prefix_blocks): a region publishes no more
# (region/build.py gives its prefix cache this publish limit), the registry keeps no more (every snapshot reads them).
MAX_PREFIX_BLOCKS = 4096

SERVER_OPTIONS: list[tuple[str, int]] = [
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 100),
    ("grpc.http2.max_ping_strikes", 0),
    ("grpc.max_receive_message_length", 64 << 20),  # a 1M-token prompt is 5 MB of token ids
    # grpcio sets SO_REUSEPORT by default: a second process on the same port would bind without an error and
    # the kernel would split connections between the two; off, `listen` reports the address in use
    ("grpc.so_reuseport", 0),
]


def listen(server: grpc.Server, address: str, tls: TlsFiles | None) -> int:
    """Bind `server` to `address` (mutual TLS with `tls`); the port bound. An address that cannot be bound (in
    use, not this host's) is OSError naming it (grpcio returns 0 or raises RuntimeError, by version)."""
    try:
        port = (
            server.add_insecure_port(address)
            if tls is None
            else server.add_secure_port(address, tls.server_credentials())
        )
    except RuntimeError as exc:
        raise OSError(f"cannot listen for gRPC on {address}: {exc}") from None
    if port == 0:
        raise OSError(f"cannot listen for gRPC on {address}")
    return int(port)
