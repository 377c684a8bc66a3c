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
from prfaas.transport.inbound import PartPool
from prfaas.transport.receiver_base import FrameConnection, ListeningReceiver
from prfaas.transport.receiver_core import ReceiverCore
from prfaas.transport.tickets import TicketVerifier
from prfaas.transport.tls import TlsSocket

log = logging.getLogger(__name__)
TLS_HANDSHAKE_TIMEOUT_S = 10.0


class TcpConnection(FrameConnection):
    """One sender's TCP connection; with `tls`, the handshake comes first, in its own thread."""

    def __init__(self, sock: socket.socket, core: ReceiverCore, tls: ssl.SSLContext | None = None) -> None:
        super().__init__(sock, core)
        self.tcp = sock  # `sock` becomes the TlsSocket over it
        self.tls = tls

    def serve(self) -> None:
        if self.tls is not None:  # in this connection's thread: a slow handshake holds up no one else
            try:
                self.sock = TlsSocket.wrap(self.tcp, self.tls, server_side=True, timeout_s=TLS_HANDSHAKE_TIMEOUT_S)
            except (OSError, ssl.SSLError, ConnectionError) as exc:
                log.warning("TLS handshake from %s failed: %s", _peer(self.tcp), exc)
                return
        super().serve()


def _peer(sock: socket.socket) -> str:
    try:
        host, port = sock.getpeername()[:2]
    except OSError:
        return "?"
    return f"{host}:{port}"


class TcpReceiver(ListeningReceiver[TcpConnection]):
    """Listens on (host, port); port 0 picks a free one (see `address`)."""

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
    ) -> None:
        self._ssl = ssl_context
        self._buf = sock_buf_bytes
        listener = socket.create_server((host, port), backlog=128)
        self.address: tuple[str, int] = listener.getsockname()[:2]
        core = ReceiverCore(verifier, node, pool)  # pool: part buffers (None: the heap pool)
        super().__init__(listener, core, name="kv", reap_interval_s=reap_interval_s)

    def connection(self, sock: socket.socket) -> TcpConnection:
        sockets.configure(sock, self._buf)
        sockets.send_timeout(sock, sockets.SEND_TIMEOUT_S)  # no reply waits forever on a sender
        return TcpConnection(sock, self.core, self._ssl)
