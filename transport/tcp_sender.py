"""The TCP sender: a pool of persistent connections to one receiver, shared by all jobs.

Chunks of every live transfer wait in one queue, earliest deadline first; each stream
thread takes the next chunk, sends the shipment's OPEN first if this connection has not
carried it yet, then the DATA frame. A reader thread per stream applies ACK / NACK / DONE
/ ERROR / CANCEL. When a connection breaks, its unacknowledged chunks go back into the
queue for the other streams, and the stream reconnects with exponential backoff.
At most `max_inflight_bytes` are unacknowledged at a time (backpressure).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import ssl
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

from prfaas.transport import metrics, sockets
from prfaas.transport.adaptive import PathSample, StreamController
from prfaas.transport.api import Shipment, TransferStatus
from prfaas.transport.errors import FrameError, PeerUnavailable
from prfaas.transport.framing import Frame, FrameType, encode, json_payload, read_frame
from prfaas.transport.outbound import OutboundTransfer, TransferTable, encoder_pool
from prfaas.transport.sendqueue import SendQueue
from prfaas.transport.tls import TlsSocket

log = logging.getLogger(__name__)
LAN_RTT_S = 0.001  # below: same host or region (see StreamController.lan_rtt_s)


class _Stream:
    """One connection of the pool: a sender thread and, while connected, a reader thread."""

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
                conn = TlsSocket.wrap(sock, ch.ssl_context, server_side=False, server_hostname=ch.address[0],
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


class TcpChannel:
    """A pool of TCP connections to the receiver at `address`. Implements `Channel`.

    sock_buf_bytes: fixed SO_SNDBUF/SO_RCVBUF. Leave it None: a fixed size turns off the
    kernel's autotuning and is capped by net.core.wmem_max/rmem_max; raise
    net.ipv4.tcp_wmem/tcp_rmem instead for long fat paths.
    num_streams: a fixed count, or None (the default) to let a `StreamController` choose it
    from the path's queueing delay (WAN) or goodput (LAN), between 1 and `max_streams` (see
    transport/adaptive.py); `num_streams`, `controller.history` and the `prfaas_kv_streams`
    metric show the choice.

    A transfer that cannot reach the receiver fails with `PeerUnavailable` once every
    stream has failed to connect for `unavailable_after_s`, or times out at its deadline,
    whichever comes first.
    """

    def __init__(
        self,
        address: tuple[str, int],
        *,
        num_streams: int | None = None,
        max_streams: int = 64,
        max_inflight_bytes: int = 256 << 20,
        connect_timeout_s: float = 3.0,
        unavailable_after_s: float = 5.0,
        sock_buf_bytes: int | None = None,
        congestion_control: str | None = None,
        ssl_context: ssl.SSLContext | None = None,
        encode_threads: int = 2,
        node: str = "sender",
        dialer: Callable[[float], Any] | None = None,
    ) -> None:
        if num_streams is not None and not 1 <= num_streams <= 256:
            raise ValueError(f"num_streams must be in [1, 256], got {num_streams}")
        self.controller = None if num_streams is not None else StreamController(max_streams=max_streams)
        self.address = address
        self.connect_timeout_s = connect_timeout_s
        self.unavailable_after_s = unavailable_after_s
        self.sock_buf_bytes = sock_buf_bytes
        self.congestion_control = congestion_control
        self.ssl_context = ssl_context
        self.node = node
        self.dialer = dialer  # (timeout_s) -> a connected socket-like stream; None: TCP to `address`
        self.peer = f"{address[0]}:{address[1]}"
        self.closed = threading.Event()
        self.queue = SendQueue(max_inflight_bytes)
        self.table = TransferTable()
        self._encoder = encoder_pool(encode_threads, "prfaas-kv-encode")
        self._down_since: float | None = None
        self._lock = threading.Lock()
        self._next_index = 0
        self.streams: list[_Stream] = []
        self.resize(num_streams or (self.controller.current if self.controller else 4))
        self._reaper = threading.Thread(target=self._reap_loop, name="prfaas-kv-sender-reaper", daemon=True)
        self._reaper.start()

    @property
    def num_streams(self) -> int:
        with self._lock:
            return sum(1 for s in self.streams if not s.retired)

    def resize(self, count: int) -> None:
        """Use `count` connections: open new ones, or retire the newest (they finish what they
        have on the wire, within 2 s; what is still unacknowledged then is resent elsewhere)."""
        with self._lock:
            self.streams = [s for s in self.streams if not (s.retired and not s.thread.is_alive())]
            active = [s for s in self.streams if not s.retired]
            added = []
            for _ in range(count - len(active)):
                added.append(_Stream(self, self._next_index))
                self._next_index += 1
            retiring = active[count:] if count < len(active) else []
            for stream in retiring:
                stream.retired = True
            self.streams += added
        metrics.STREAMS.labels(self.peer).set(count)
        for stream in added:
            stream.thread.start()
        # retiring streams stop taking chunks, drain their acknowledgements, then close

    def submit(self, shipment: Shipment) -> OutboundTransfer:
        if self.closed.is_set():
            raise PeerUnavailable("channel is closed")
        transfer = OutboundTransfer(shipment, self.queue.put, self._encoder)
        self.table.add(transfer)
        transfer.cell.on_terminal(lambda status: self._ended(transfer, status))
        any(stream.send_open(transfer) for stream in self.streams)  # first connected stream
        transfer.start()
        return transfer

    def _ended(self, transfer: OutboundTransfer, status: TransferStatus) -> None:
        metrics.TRANSFERS.labels(self.peer, status.value).inc()
        metrics.WIRE_BYTES.labels(self.peer).inc(transfer.stats.wire_bytes)
        metrics.RESENT_CHUNKS.labels(self.peer).inc(transfer.stats.resent_chunks)
        if status is TransferStatus.COMPLETED:
            metrics.RAW_BYTES.labels(self.peer, transfer.spec.codec).inc(transfer.spec.raw_bytes)
        if status is not TransferStatus.COMPLETED and not transfer.remote_ended:
            job, attempt = transfer.key
            cancel = Frame(FrameType.CANCEL, job, attempt, payload=str(transfer.error).encode()[:1000])
            for stream in self.streams:
                if transfer.key in stream.opened:
                    stream.send_control(cancel)
        for stream in self.streams:
            stream.opened.discard(transfer.key)
        # Whatever the outcome, its bytes no longer count against the in-flight budget.
        self.queue.release(transfer.drop_unacked())

    def connect_ok(self, _stream: _Stream) -> None:
        with self._lock:
            self._down_since = None

    def connect_failed(self, stream: _Stream, exc: Exception) -> None:
        log.debug("stream %d to %s failed to connect: %s", stream.index, self.address, exc)
        with self._lock:
            if any(s.connected.is_set() for s in self.streams):
                return
            now = time.monotonic()
            self._down_since = self._down_since or now
            down_for = now - self._down_since
        if down_for >= self.unavailable_after_s:
            for transfer in self.table.live():
                transfer.cell.finish(
                    TransferStatus.FAILED,
                    PeerUnavailable(
                        f"cannot connect to {self.address[0]}:{self.address[1]} for {down_for:.1f} s: {exc}"
                    ),
                )

    def _reap_loop(self) -> None:
        """Deadlines every 50 ms; every measurement window, the stream count."""
        window_start, samples, backlogged = time.monotonic(), 0, 0
        srtts: list[float] = []
        min_rtt: float | None = None
        # Goodput from the kernel's per-connection byte counts, not from chunk ACKs: on a slow
        # lossy path a stream completes a 1 MiB chunk every few seconds, so chunk ACKs per
        # window are a handful of bursts, not a rate.
        acked_at_start: dict[int, int] = {}
        acked_now: dict[int, int] = {}
        while not self.closed.wait(0.05):
            now = time.monotonic()
            for transfer in self.table.live():
                transfer.cell.expire_if_due(now)
            metrics.STREAMS_CONNECTED.labels(self.peer).set(self.num_connected)
            if self.controller is None:
                continue
            samples += 1
            infos = {s.index: i for s in self.streams if (i := s.tcp_info()) is not None}
            # data waits for the path: chunks queued for a stream, or bytes in the socket buffers
            backlogged += int(self.queue.backlogged() or sum(i.notsent_bytes for i in infos.values()) > 0)
            srtts += [i.srtt_s for i in infos.values()]  # every 50 ms: CUBIC's queue swings within a window
            min_rtt = min((i.min_rtt_s for i in infos.values()), default=min_rtt)
            for index, info in infos.items():
                if acked_now.get(index, 0) > info.bytes_acked:  # a reconnected stream: a new count
                    acked_at_start[index] = 0
                acked_now[index] = info.bytes_acked
            if now - window_start < self.controller.window_s(min_rtt):
                continue
            rate = sum(n - acked_at_start.get(i, 0) for i, n in acked_now.items()) / (now - window_start)
            path = PathSample(statistics.median(srtts), min_rtt) if srtts and min_rtt is not None else None
            if path is not None:
                metrics.QUEUEING_DELAY.labels(self.peer).set(max(0.0, path.srtt_s - path.min_rtt_s))
            count = self.controller.update(now, rate, backlogged=backlogged >= 0.8 * samples, path=path)
            if count != self.num_streams:
                log.info(
                    "streams to %s: %d -> %d (%.1f MB/s, queueing %s)", self.address, self.num_streams, count,
                    rate / 1e6, f"{1e3 * (path.srtt_s - path.min_rtt_s):.1f} ms" if path else "unknown",
                )  # fmt: skip
                self.resize(count)
            live = {s.index for s in self.streams}
            acked_at_start = {i: n for i, n in acked_now.items() if i in live}
            acked_now = dict(acked_at_start)
            window_start, samples, backlogged, srtts = now, 0, 0, []

    @property
    def num_connected(self) -> int:
        return sum(1 for s in self.streams if s.connected.is_set())

    def close(self, timeout_s: float = 5.0) -> None:
        """Cancel live transfers, close every connection, join every thread."""
        for transfer in self.table.live():
            transfer.cancel()
        self.closed.set()
        self.queue.close()
        with self._lock:
            streams = list(self.streams)
        for stream in streams:
            stream.kill()
        for stream in streams:
            stream.thread.join(timeout_s)
        self._reaper.join(timeout_s)
        self._encoder.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> TcpChannel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
