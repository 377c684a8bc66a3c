"""The TCP receiver: a decode region's KV port.

One thread accepts, one thread per connection reads frames and hands them to
`ReceiverCore`; replies are written under a per-connection lock. A reaper thread ends
shipments at their deadline. `close()` stops and joins every thread it started.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import ssl
import threading

from prfaas.transport import sockets
from prfaas.transport.errors import FrameError
from prfaas.transport.framing import (
    HEADER_SIZE,
    ErrorCode,
    Frame,
    encode,
    error_frame,
    parse_header,
    payload_ok,
    read_exact,
    read_into,
    to_frame,
)
from prfaas.transport.inbound import Inbound, PartPool
from prfaas.transport.receiver_core import Connections, ReceiverCore, Session
from prfaas.transport.tickets import TicketVerifier
from prfaas.transport.tls import TlsSocket

log = logging.getLogger(__name__)
TLS_HANDSHAKE_TIMEOUT_S = 10.0


class _Connection:
    def __init__(self, sock: socket.socket, core: ReceiverCore, tls: ssl.SSLContext | None = None) -> None:
        self.raw = sock
        self.sock: socket.socket | TlsSocket = sock
        self.tls = tls
        self.core = core
        self._write_lock = threading.Lock()
        self.session = Session(self.send)
        self.thread = threading.Thread(target=self._run, name="prfaas-kv-conn", daemon=True)

    def send(self, frame: Frame) -> None:
        data = encode(frame)
        try:
            with self._write_lock:
                self.sock.sendall(data)
        except OSError:  # broken, or a sender that stopped reading (part of a frame may be out)
            self.close()  # the reader then ends the connection; the sender resends on another

    def _run(self) -> None:
        if self.tls is not None:  # in this connection's thread: a slow handshake holds up no one else
            try:
                self.sock = TlsSocket.wrap(self.raw, self.tls, server_side=True, timeout_s=TLS_HANDSHAKE_TIMEOUT_S)
            except (OSError, ssl.SSLError, ConnectionError) as exc:
                log.warning("TLS handshake from %s failed: %s", _peer(self.raw), exc)
                self.close()
                return
        try:
            while True:
                header = parse_header(read_exact(self.sock, HEADER_SIZE))
                view = self.core.data_slot(header, self.session) if header.payload_len else None
                if view is not None:  # KV goes from the socket straight into its layer buffer
                    try:
                        read_into(self.sock, view)
                    except BaseException:
                        self.core.data_commit(header, payload_ok=False)  # release the claim
                        raise
                    replies = self.core.data_commit(header, payload_ok(header, view))
                else:
                    payload = read_exact(self.sock, header.payload_len) if header.payload_len else bytearray()
                    replies = self.core.handle(to_frame(header, payload), payload_ok(header, payload), self.session)
                for reply in replies:
                    self.send(reply)
        except FrameError as exc:
            self.send(error_frame(ErrorCode.BAD_FRAME, str(exc)))
        except (OSError, ConnectionError):
            pass
        finally:
            self.close()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.raw.shutdown(socket.SHUT_RDWR)
        self.raw.close()


def _peer(sock: socket.socket) -> str:
    try:
        host, port = sock.getpeername()[:2]
    except OSError:
        return "?"
    return f"{host}:{port}"


class TcpReceiver:
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
        self.core = ReceiverCore(verifier, node, pool)  # pool: part buffers (None: the heap pool)
        self._ssl = ssl_context
        self._buf = sock_buf_bytes
        self._listener = socket.create_server((host, port), backlog=128)
        self.address: tuple[str, int] = self._listener.getsockname()[:2]
        self._connections: Connections[_Connection] = Connections(self.core, reap_interval_s, "prfaas-kv-reaper")
        self._acceptor = threading.Thread(target=self._accept_loop, name="prfaas-kv-accept", daemon=True)
        self._acceptor.start()

    def expect(self, job_id: str, attempt: int, timeout_s: float) -> Inbound:
        return self.core.expect(job_id, attempt, timeout_s)

    def _accept_loop(self) -> None:
        while not self._connections.closed.is_set():
            try:
                sock, _peer = self._listener.accept()
            except OSError:
                return  # listener closed
            sockets.configure(sock, self._buf)
            sockets.send_timeout(sock, sockets.SEND_TIMEOUT_S)  # no reply waits forever on a sender
            connection = _Connection(sock, self.core, self._ssl)
            if not self._connections.add(connection):
                connection.close()
                return
            connection.thread.start()

    @property
    def num_connections(self) -> int:
        return self._connections.live

    def close(self, timeout_s: float = 5.0) -> None:
        """Cancel expected shipments, stop accepting, close connections, join threads."""
        self.core.cancel_all("receiver shutting down")
        connections = self._connections.closing()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked in accept()
        self._listener.close()
        for connection in connections:
            connection.close()
        threads = [self._acceptor, self._connections.reaper, *(c.thread for c in connections)]
        for thread in threads:
            if thread.is_alive() and thread is not threading.current_thread():
                thread.join(timeout_s)

    def __enter__(self) -> TcpReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
