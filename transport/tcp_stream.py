"""One stream of the TCP sender's pool (transport/tcp_sender.py): a connection, its sender
thread and its reader thread.

The sender thread connects (with backoff), says HELLO, then takes chunks from the channel's
queue and writes each, after its shipment's OPEN if this connection has not carried it yet.
The reader thread applies the receiver's replies to the channel's transfers. A broken
connection puts its unacknowledged chunks back in the queue, for this stream once it has
reconnected, or for the others.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import threading
import time
from typing import TYPE_CHECKING

from prfaas.transport import sockets
from prfaas.transport.adaptive import LAN_RTT_S
from prfaas.transport.errors import FrameError
from prfaas.transport.framing import Frame, FrameType, encode, json_payload, read_frame
from prfaas.transport.outbound import OutboundTransfer
from prfaas.transport.tls import TlsSocket

if TYPE_CHECKING:
    from prfaas.transport.tcp_sender import TcpChannel


class TcpStream:
    """One connection of a `TcpChannel`'s pool: a sender thread and, while connected, a reader thread."""

    def __init__(self, channel: TcpChannel, index: int) -> None:
        self.channel = channel
        self.index = index
        self.sock: socket.socket | TlsSocket | None = None
        self.opened: set[tuple[bytes, int]] = set()
        self.connected = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"prfaas-kv-stream-{index}", daemon=True)
        self.reader: threading.Thread | None = None
        self.retired = False  # the channel shrank: finish, don't reconnect
        self._write_lock = threading.Lock()

    def _connect(self) -> socket.socket | TlsSocket:
        ch = self.channel
        if ch.dialer is not None:  # another byte stream under the same protocol (transport/webrtc_sender.py)
            return self._hello(ch.dialer(ch.connect_timeout_s))
        sock = socket.create_connection(ch.address, timeout=ch.connect_timeout_s)
        sockets.configure(sock, ch.sock_buf_bytes)
        if ch.congestion_control:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, ch.congestion_control.encode())
        conn: socket.socket | TlsSocket = sock
        if ch.ssl_context is not None:
            try:
                name = ch.server_hostname or ch.address[0]
                conn = TlsSocket.wrap(sock, ch.ssl_context, server_side=False, server_hostname=name,
                                      timeout_s=ch.connect_timeout_s)  # fmt: skip
            except BaseException:
                sock.close()
                raise
            conn.settimeout(ch.connect_timeout_s)
        return self._hello(conn)

    def _hello(self, sock: socket.socket | TlsSocket) -> socket.socket | TlsSocket:
        ch = self.channel
        sock.sendall(encode(Frame(FrameType.HELLO, payload=json_payload({"versions": [1], "node": ch.node}))))
        reply, _ok = read_frame(sock)  # bounded by the connect timeout still set on the socket
        if reply.type is not FrameType.HELLO_OK:
            raise FrameError(f"receiver answered HELLO with {reply.type.name}: {bytes(reply.payload)[:200]!r}")
        sock.settimeout(None)
        if isinstance(sock, socket.socket | TlsSocket):  # (a WebRTC data channel stands in for one too)
            sockets.send_timeout(sock, sockets.SEND_TIMEOUT_S)  # a send that makes no progress drops the stream
        self.sock = sock
        info = self.tcp_info()  # the handshake gave an RTT sample
        if info is not None and info.min_rtt_s >= LAN_RTT_S:
            sockets.limit_unsent(sock)
        return sock

    def _run(self) -> None:
        ch = self.channel
        backoff_s = 0.05
        while not ch.closed.is_set() and not self.retired:
            try:
                self.sock = self._connect()
            except (OSError, FrameError, ssl.SSLError) as exc:
                ch.connect_failed(self, exc)
                if ch.closed.wait(backoff_s):
                    return
                backoff_s = min(backoff_s * 2, 2.0)
                continue
            backoff_s = 0.05
            ch.connect_ok(self)
            self.connected.set()
            for transfer in ch.table.live():  # submitted while no stream was up: open them now
                if not any(transfer.key in s.opened for s in ch.streams):
                    self.send_open(transfer)
            self.reader = threading.Thread(target=self._read, name=f"prfaas-kv-reader-{self.index}", daemon=True)
            self.reader.start()
            self._send_loop()
            if self.retired:
                self._drain()
            self._drop()

    def _send_loop(self) -> None:
        ch = self.channel
        while self.connected.is_set() and not ch.closed.is_set() and not self.retired:
            chunk = ch.queue.get(timeout_s=0.1)
            if chunk is None:
                continue
            transfer = chunk.transfer
            try:
                with self._write_lock:
                    assert self.sock is not None
                    if transfer.key not in self.opened:
                        self.opened.add(transfer.key)
                        self.sock.sendall(transfer.open_frame)
                    resend = chunk.stream is not None
                    transfer.sent(chunk, self.index, resend)
                    sockets.send_frame(self.sock, chunk.header, chunk.payload)
            except OSError:
                ch.queue.release([chunk])
                ch.queue.put([chunk])
                return

    def _drain(self, timeout_s: float = 2.0) -> None:
        """Retiring: wait (bounded) for this connection's chunks to be acknowledged, so
        shrinking the pool does not resend what was already on the wire."""
        end = time.monotonic() + timeout_s
        while self.connected.is_set() and time.monotonic() < end:
            if not any(t.unacked_on(self.index) for t in self.channel.table.live()):
                return
            time.sleep(0.02)

    def send_open(self, transfer: OutboundTransfer) -> bool:
        """Send the transfer's OPEN now if connected (so a bad ticket fails before any KV exists)."""
        try:
            with self._write_lock:
                if self.sock is None or not self.connected.is_set():
                    return False
                if transfer.key not in self.opened:
                    self.opened.add(transfer.key)
                    self.sock.sendall(transfer.open_frame)
            return True
        except OSError:
            self._break()
            return False

    def send_control(self, frame: Frame) -> bool:
        try:
            with self._write_lock:
                if self.sock is None or not self.connected.is_set():
                    return False
                self.sock.sendall(encode(frame))
            return True
        except OSError:
            self._break()
            return False

    def _break(self) -> None:
        """A send failed, perhaps part-way through a frame: end this connection (its reader
        and send loop see it) so that it reconnects and its chunks are resent."""
        sock = self.sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def _read(self) -> None:
        ch = self.channel
        sock = self.sock
        assert sock is not None
        try:
            while True:
                frame, _ok = read_frame(sock)
                if frame.type is FrameType.PING:
                    self.send_control(Frame(FrameType.PONG, payload=frame.payload))
                    continue
                acked, resend = ch.table.on_reply(frame)
                ch.queue.release(acked + resend)
                if resend:
                    ch.queue.put(resend)
        except (OSError, ConnectionError, FrameError):
            pass
        finally:
            self.connected.clear()

    def _drop(self) -> None:
        """Connection lost: close it and put its unacknowledged chunks back in the queue."""
        self.connected.clear()
        sock, self.sock = self.sock, None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        if self.reader is not None:
            self.reader.join(5.0)
        self.opened.clear()
        lost = [c for t in self.channel.table.live() for c in t.unacked_on(self.index)]
        for chunk in lost:
            chunk.stream = -1  # its next send counts as a resend
        self.channel.queue.release(lost)
        self.channel.queue.put(lost)

    def tcp_info(self) -> sockets.TcpInfo | None:
        """The kernel's view of this connection, if connected and measured."""
        sock = self.sock
        return sockets.tcp_info(sock) if sock is not None else None

    def kill(self) -> None:
        """Break the connection now (tests, and `close`)."""
        sock = self.sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
