"""One stream of the TCP sender's pool (transport/tcp_sender.py): a connection, its sender
thread and its reader thread.

The sender thread connects (with backoff), says HELLO, then takes chunks from the channel's
queue and writes each, after its shipment's OPEN if this connection has not carried it yet.
It alone writes to the connection: control frames from other threads (OPEN at submit, CANCEL,
PING, PONG) wait in `_control` for it, so no caller ever blocks on a stalled send. The reader
thread applies the receiver's replies to the channel's transfers. A broken connection puts its
unacknowledged chunks back in the queue, for this stream once it has reconnected, or for the
others. The channel's reaper (`watch`) ends a connection whose path went silent (a link cut:
no RST, no error, only unacknowledged bytes), so its chunks are resent once a path is back.
"""

from __future__ import annotations

import contextlib
import logging
import random
import socket
import ssl
import struct
import threading
import time
from collections import deque
from typing import TYPE_CHECKING

from prfaas.transport import sockets
from prfaas.transport.adaptive import LAN_RTT_S
from prfaas.transport.errors import FrameError
from prfaas.transport.framing import (
    HEADER_SIZE,
    Frame,
    FrameType,
    encode,
    json_payload,
    parse_header,
    read_exact,
    read_frame,
    to_frame,
)
from prfaas.transport.outbound import OutboundTransfer
from prfaas.transport.tls import TlsSocket

if TYPE_CHECKING:
    from prfaas.transport.tcp_sender import TcpChannel

log = logging.getLogger(__name__)
RECONNECT_FIRST_S, RECONNECT_MAX_S = 0.1, 2.0  # backoff between connection attempts, doubling, jittered
PING_AFTER_S = 1.0  # a connection that owes replies and has been silent this long is pinged
MAX_HELLO_OK_BYTES = 4 << 10  # a HELLO_OK is ~30 bytes; an ERROR answering HELLO a line of text


class _Before:
    """Reads from `sock` that all end by `deadline` (time.monotonic()): each waits only what is left, so a peer
    trickling a reply a byte at a time cannot stretch the wait (a socket timeout bounds one read only)."""

    def __init__(self, sock: socket.socket | TlsSocket, deadline: float) -> None:
        self.sock, self.deadline = sock, deadline

    def left(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the receiver did not answer HELLO in time")
        return left

    def recv_into(self, buffer: memoryview, nbytes: int = 0, /) -> int:
        self.sock.settimeout(self.left())
        return self.sock.recv_into(buffer, nbytes)


def refused(exc: BaseException) -> bool:
    """A failed connection attempt that the receiver's host answered: nothing listens (RST), it
    reset or closed the connection, or refused the TLS handshake or HELLO. Silence (a timeout)
    or no route is what a link outage looks like instead."""
    return isinstance(exc, ConnectionError | FrameError | ssl.SSLError)


class TcpStream:
    """One connection of a `TcpChannel`'s pool: a sender thread and, while connected, a reader thread."""

    def __init__(self, channel: TcpChannel, index: int) -> None:
        self.channel = channel
        self.index = index
        self.sock: socket.socket | TlsSocket | None = None
        self._dialing: socket.socket | None = None  # the connection being set up (TLS, HELLO): `kill` ends it
        self.opened: set[tuple[bytes, int]] = set()
        self.connected = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"prfaas-kv-stream-{index}", daemon=True)
        self.reader: threading.Thread | None = None
        self.retired = False  # the channel shrank: finish, don't reconnect
        self._write_lock = threading.Lock()
        self._control: deque[tuple[tuple[bytes, int] | None, bytes]] = deque()  # (OPEN's key, frame) to write
        # Signs of life, time.monotonic(): the last frame or kernel ACK from the receiver (or
        # the handshake), the last frame written, the last PING; and when the kernel last had
        # nothing unacknowledged or saw an ACK (`_acked`: its byte count then).
        self.heard_at = self.sent_at = self.pinged_at = self._progress_at = 0.0
        self._acked = -1

    def _connect(self) -> socket.socket | TlsSocket:
        ch = self.channel
        if ch.dialer is not None:  # another byte stream under the same protocol (transport/webrtc_sender.py)
            dialed = ch.dialer(ch.connect_timeout_s)
            try:
                return self._hello(dialed)
            except BaseException:
                dialed.close()
                raise
        deadline = time.monotonic() + ch.connect_timeout_s  # for the whole setup: connect, TLS, HELLO
        sock = socket.create_connection(ch.address, timeout=ch.connect_timeout_s)
        self._dialing = sock
        conn: socket.socket | TlsSocket = sock
        try:
            if ch.closed.is_set():  # `close` ran while this connected: it could not reach the socket
                raise OSError("channel closed")
            sockets.configure(sock, ch.sock_buf_bytes)
            if ch.congestion_control:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, ch.congestion_control.encode())
            if ch.ssl_context is not None:
                name = ch.server_hostname or ch.address[0]
                conn = TlsSocket.wrap(sock, ch.ssl_context, server_side=False, server_hostname=name,
                                      timeout_s=max(0.001, deadline - time.monotonic()))  # fmt: skip
            return self._hello(conn, deadline)
        except BaseException:
            conn.close()
            if conn is not sock:
                sock.close()
            raise
        finally:
            self._dialing = None

    def _hello(self, sock: socket.socket | TlsSocket, deadline: float | None = None) -> socket.socket | TlsSocket:
        """Say HELLO and read HELLO_OK, all before `deadline` (default: the connect timeout from now), however
        slowly the peer trickles its reply, and at most MAX_HELLO_OK_BYTES of it."""
        ch = self.channel
        before = _Before(sock, time.monotonic() + ch.connect_timeout_s if deadline is None else deadline)
        sock.settimeout(before.left())
        sock.sendall(encode(Frame(FrameType.HELLO, payload=json_payload({"versions": [1], "node": ch.node}))))
        header = parse_header(read_exact(before, HEADER_SIZE))
        if header.payload_len > MAX_HELLO_OK_BYTES:
            raise FrameError(f"receiver's reply to HELLO announces {header.payload_len} bytes (at most "
                             f"{MAX_HELLO_OK_BYTES})")  # fmt: skip
        reply = to_frame(header, read_exact(before, header.payload_len))
        if reply.type is not FrameType.HELLO_OK:
            raise FrameError(f"receiver answered HELLO with {reply.type.name}: {bytes(reply.payload)[:200]!r}")
        sock.settimeout(None)
        self.heard_at = self._progress_at = time.monotonic()
        self._acked = -1
        if isinstance(sock, socket.socket | TlsSocket):  # (a WebRTC data channel stands in for one too)
            sockets.send_timeout(sock, sockets.SEND_TIMEOUT_S)  # a send that makes no progress drops the stream
        self.sock = sock
        info = self.tcp_info()  # the handshake gave an RTT sample
        if info is not None and info.min_rtt_s >= LAN_RTT_S:
            sockets.limit_unsent(sock)
        return sock

    def _run(self) -> None:
        ch = self.channel
        backoff_s = RECONNECT_FIRST_S
        while not ch.closed.is_set() and not self.retired:
            try:
                self.sock = self._connect()
            except Exception as exc:
                if not isinstance(exc, OSError | FrameError | ssl.SSLError):  # a dialer's bug: this stream goes on
                    log.exception("stream %d to %s: connecting failed", self.index, ch.peer)
                    exc = ConnectionError(f"connecting failed: {exc!r}")
                ch.connect_failed(self, exc)
                # jittered, so the pool's streams probe a path that came back at different moments
                if ch.closed.wait(backoff_s * random.uniform(0.5, 1.0)):
                    return
                backoff_s = min(backoff_s * 2, RECONNECT_MAX_S)
                continue
            backoff_s = RECONNECT_FIRST_S
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
            try:
                self._flush_control()
            except OSError:
                return
            if self.heard_at < ch.suspect_since:
                # The path failed (another connection stalled) since this one last heard from
                # the receiver: send it nothing until its PING is answered, or it stalls too.
                ch.queue.wait(0.05, self.has_control)
                continue
            chunk = ch.queue.get(timeout_s=0.1, interrupt=self.has_control, stream=self.index)  # `_drop` finds it
            if chunk is None:
                continue
            transfer = chunk.transfer
            try:
                with self._write_lock:
                    assert self.sock is not None
                    self._open(self.sock, transfer)  # (may wait on a full socket)
                    if chunk.acked or transfer.cell.status().terminal:  # meanwhile: no copy after the end
                        ch.queue.release([chunk])
                        continue
                    sockets.send_frame(self.sock, chunk.header, chunk.payload)
                self.sent_at = time.monotonic()
                transfer.sent(chunk)
            except OSError:
                return  # `_drop` puts the chunk back, with what else this connection had

    def has_control(self) -> bool:
        """Control frames wait for this stream's thread."""
        return bool(self._control)

    def _flush_control(self) -> None:
        """Write the control frames other threads handed this stream (raises OSError)."""
        while self._control:
            key, data = self._control.popleft()
            with self._write_lock:
                if self.sock is None:
                    return
                if key is None:
                    self.sock.sendall(data)
                elif (transfer := self.channel.table.get(key)) is None or not self._open(self.sock, transfer):
                    continue  # an OPEN: once per connection, and only for a live transfer
            self.sent_at = time.monotonic()

    def _drain(self, timeout_s: float = 2.0) -> None:
        """Retiring: wait (bounded) for this connection's chunks to be acknowledged, so
        shrinking the pool does not resend what was already on the wire."""
        end = time.monotonic() + timeout_s
        while self.connected.is_set() and time.monotonic() < end:
            if not any(t.unacked_on(self.index) for t in self.channel.table.live()):
                return
            time.sleep(0.02)

    def send_open(self, transfer: OutboundTransfer) -> bool:
        """Send the transfer's OPEN now (from this stream's thread) or soon (from another: it
        never waits on a send), if connected, so a bad ticket fails before any KV exists."""
        if threading.current_thread() is not self.thread:
            return self._post(transfer.key, transfer.open_frame)
        try:
            with self._write_lock:
                if self.sock is None or not self.connected.is_set():
                    return False
                self._open(self.sock, transfer)
            return True
        except OSError:
            self._break()
            return False

    def _open(self, sock: socket.socket | TlsSocket, transfer: OutboundTransfer) -> bool:
        """The transfer's OPEN, once per connection, under the write lock (raises OSError). Marked opened
        first, sent only if still live after: the channel's `_ended` CANCELs it on the connections it finds
        it opened on (after the end), so an OPEN that goes out is always followed by its CANCEL, and one of a
        transfer that ended unseen never goes out (the receiver would keep it, and its reservation, until its
        deadline; a CANCEL for a shipment it has not seen is ignored). True: it went out now."""
        if transfer.key in self.opened:
            return False
        self.opened.add(transfer.key)
        if transfer.cell.status().terminal:
            self.opened.discard(transfer.key)
            return False
        sock.sendall(transfer.open_frame)
        return True

    def send_control(self, frame: Frame) -> bool:
        """Hand a control frame to this stream's thread, if connected: the caller never waits
        on a send (one stuck on a stalled path holds the connection up to SEND_TIMEOUT_S)."""
        return self._post(None, encode(frame))

    def _post(self, key: tuple[bytes, int] | None, data: bytes) -> bool:
        if self.sock is None or not self.connected.is_set():
            return False
        self._control.append((key, data))
        self.channel.queue.wake()
        return True

    def watch(self, now: float, info: sockets.TcpInfo | None, stall_timeout_s: float) -> bool:
        """The channel's reaper, every tick: True when this connection's path is silent, bytes
        unacknowledged by the receiver's kernel for `stall_timeout_s` (a cut link); a receiver
        that stops reading is not silent (its kernel answers window probes). Else PING it when
        it owes replies and has been quiet PING_AFTER_S, or the path failed since it last heard."""
        if not self.connected.is_set():
            return False
        if info is not None:
            if info.bytes_acked != self._acked:
                if self._acked >= 0:
                    self.heard_at = now
                self._acked, self._progress_at = info.bytes_acked, now
            elif info.unacked == 0:
                self._progress_at = now
            elif now - self._progress_at >= stall_timeout_s:
                self._progress_at = now  # once: the caller resets it
                return True
        quiet = self.heard_at < self.channel.suspect_since or (
            self.sent_at > self.heard_at and now - self.heard_at >= PING_AFTER_S
        )
        if quiet and self.pinged_at < max(self.channel.suspect_since, now - PING_AFTER_S):
            self.pinged_at = now  # unanswered, it is unacknowledged bytes: silence shows as above
            self.send_control(Frame(FrameType.PING, payload=struct.pack("<d", now)))
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
                frame, ok = read_frame(sock)
                if not ok:  # a flipped bit in an ACK would acknowledge a chunk never stored: end the connection
                    raise FrameError("reply payload checksum mismatch")  # (`_drop` resends what it had unacked)
                self.heard_at = time.monotonic()
                if frame.type is FrameType.PONG:
                    continue
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
        self._control.clear()  # frames for this connection: a new one sends OPENs afresh
        sock, self.sock = self.sock, None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        if self.reader is not None:
            self.reader.join(5.0)
        self.opened.clear()
        lost = [c for t in self.channel.table.live() for c in t.unacked_on(self.index)]
        self.channel.queue.requeue_lost(lost, self.index)  # those no other stream took since

    def tcp_info(self) -> sockets.TcpInfo | None:
        """The kernel's view of this connection, if connected and measured."""
        sock = self.sock
        return sockets.tcp_info(sock) if sock is not None else None

    def kill(self, *, silent: bool = False) -> None:
        """Break the connection now (tests, `close`, and a `silent` path: then closing it resets
        it, so the kernel drops what it still holds instead of sending it again when the link
        returns, bytes that no resend count would show)."""
        sock = self.sock or self._dialing
        if sock is not None:
            if silent:
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
