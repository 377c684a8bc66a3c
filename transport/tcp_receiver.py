"""The TCP receiver: a decode region's KV port.

One thread accepts, one thread per connection reads frames and hands them to
`ReceiverCore`; replies are written under a per-connection lock. A reaper thread ends
shipments at their deadline (transport/receiver_base.py, shared with the other receivers).
`close()` stops and joins every thread it started.
"""

from __future__ import annotations

import logging
import socket
import ssl

from prfaas.transport import sockets
from prfaas.transport.admission import REFUSED, ReceiverLimits, Throttled, discard
from prfaas.transport.buffers import PartPool
from prfaas.transport.framing import ErrorCode, Header, error_frame, payload_ok
from prfaas.transport.identity import Identity, identity_of
from prfaas.transport.receiver_base import FrameConnection, ListeningReceiver, Payload
from prfaas.transport.receiver_core import ReceiverCore
from prfaas.transport.tickets import TicketVerifier
from prfaas.transport.tls import TlsSocket

log = logging.getLogger(__name__)
_refusals = Throttled()


class TcpConnection(FrameConnection):
    """One sender's TCP connection; with `tls`, the handshake comes first, in its own thread,
    and the peer's certificate must name an identity that serves prefill."""

    def __init__(self, sock: socket.socket, core: ReceiverCore, limits: ReceiverLimits,
                 tls: ssl.SSLContext | None = None) -> None:  # fmt: skip
        super().__init__(sock, core, limits)
        self.tcp = sock  # `sock` becomes the TlsSocket over it
        self.tls = tls
        self.session.peer = _peer(sock).rpartition(":")[0]  # its address; over TLS, its identity

    def serve(self) -> None:
        if self.tls is not None:  # in this connection's thread: a slow handshake holds up no one else
            try:
                tls = TlsSocket.wrap(self.tcp, self.tls, server_side=True, timeout_s=self.limits.handshake_timeout_s)
            except (OSError, ssl.SSLError, ConnectionError) as exc:
                _refusals.warn("TLS handshake from %s failed: %s", _peer(self.tcp), exc)
                return
            self.sock = tls
            certificate = tls.peer_certificate()
            identity = identity_of(certificate) if certificate else None
            refusal = _refusal(identity)
            if refusal is not None:
                REFUSED.labels("peer_identity").inc()
                _refusals.warn("KV connection from %s refused: %s", _peer(self.tcp), refusal)
                self._refuse(refusal)
                return
            self.session.authenticated = True
            self.session.peer = identity.uri if identity else ""  # (never None here: refused)
        super().serve()

    def verify(self, header: Header, payload: Payload) -> bool:
        """Over TLS a sender leaves payload_xxh3 0 (the record's AEAD tag already authenticates
        every byte); a checksum that is there is verified all the same."""
        if self.tls is not None and header.payload_xxh3 == 0:
            return True
        return payload_ok(header, payload)

    def _refuse(self, message: str) -> None:
        """Read the sender's HELLO (so closing sends FIN, not RST over the reply), answer ERROR."""
        try:
            header = self.next_header()
            self._scratch = bytearray(self.limits.max_hello_bytes)
            discard(self.sock, header.payload_len, self._scratch)
        except (OSError, ConnectionError, ValueError):
            pass
        self.send(error_frame(ErrorCode.PEER_REFUSED, message))


def _refusal(identity: Identity | None) -> str | None:
    """Why a KV receiver refuses a TLS peer whose certificate names `identity`, or None: it
    accepts prefill regions only (`prfaas://prefill/...` or `prfaas://both/...`)."""
    if identity is None:
        return "the peer's certificate names no prfaas identity; a KV receiver accepts prefill regions only"
    if not identity.serves_prefill:
        return f"peer {identity} does not serve prefill; a KV receiver accepts prefill regions only"
    return None


def _peer(sock: socket.socket) -> str:
    try:
        host, port = sock.getpeername()[:2]
    except OSError:
        return "?"
    return f"{host}:{port}"


class TcpReceiver(ListeningReceiver[TcpConnection]):
    """Listens on (host, port); port 0 picks a free one (see `address`).

    ssl_context: mutual TLS (transport/tls.py `server_context`); a sender must then present
    a certificate from the CA that names a prefill-serving identity (transport/identity.py).
    limits: connection caps, the handshake deadline and frame sizes (transport/admission.py)."""

    def __init__(
        self,
        verifier: TicketVerifier,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        node: str = "receiver",
        ssl_context: ssl.SSLContext | None = None,
        sock_buf_bytes: int | None = None,
        reap_interval_s: float = 0.05,
        pool: PartPool | None = None,
        limits: ReceiverLimits | None = None,
    ) -> None:
        self._ssl = ssl_context
        self._buf = sock_buf_bytes
        limits = limits or ReceiverLimits()
        # a backlog as deep as the cap: a burst of connections waits to be admitted (or evicted
        # by the limits), rather than having its SYNs dropped and retried a second later
        listener = socket.create_server((host, port), backlog=min(limits.max_connections, 4096))
        self.address: tuple[str, int] = listener.getsockname()[:2]
        core = ReceiverCore(verifier, node, pool)  # pool: part buffers (None: the heap pool)
        super().__init__(listener, core, name="kv", reap_interval_s=reap_interval_s, limits=limits)

    def connection(self, sock: socket.socket) -> TcpConnection:
        sockets.configure(sock, self._buf)
        sockets.send_timeout(sock, sockets.SEND_TIMEOUT_S)  # no reply waits forever on a sender
        return TcpConnection(sock, self.core, self.limits, self._ssl)
