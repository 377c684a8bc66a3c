"""The TCP sender: a pool of persistent connections to one receiver, shared by all jobs.

Chunks of every live transfer wait in one queue, earliest deadline first; each stream
thread takes the next chunk, sends the shipment's OPEN first if this connection has not
carried it yet, then the DATA frame. A reader thread per stream applies ACK / NACK / DONE
/ ERROR / CANCEL. When a connection breaks, its unacknowledged chunks go back into the
queue for the other streams, and the stream reconnects with exponential backoff.
At most `max_inflight_bytes` are unacknowledged at a time (backpressure), so that is also the
most a broken path makes the channel send again. One stream of the pool:
transport/tcp_stream.py.

Outages (docs/transports.md, "Link outages"): a connection whose bytes go unacknowledged for
`stall_timeout_s` is ended, and every stream keeps reconnecting while the link is silent; a
transfer waits for it until its own deadline. Only a receiver that answers and refuses fails
transfers sooner (`unavailable_after_s`).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import ssl
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

from prfaas.transport import metrics
from prfaas.transport.adaptive import PathSample, StreamController
from prfaas.transport.api import Shipment, TransferStatus
from prfaas.transport.errors import PeerUnavailable
from prfaas.transport.framing import Frame, FrameType
from prfaas.transport.outbound import OutboundTransfer, TransferTable, encoder_pool
from prfaas.transport.pathmeter import PathMeter
from prfaas.transport.sendqueue import SendQueue
from prfaas.transport.sockets import TcpInfo
from prfaas.transport.tcp_stream import TcpStream, refused

log = logging.getLogger(__name__)


_PEERS_LOCK = threading.Lock()
_OPEN_PEERS: collections.Counter[str] = collections.Counter()  # channels open to each peer (its gauges' series)


class TcpChannel:
    """A pool of TCP connections to the receiver at `address`. Implements `Channel`.

    sock_buf_bytes: fixed SO_SNDBUF/SO_RCVBUF. Leave it None: a fixed size turns off the
    kernel's autotuning and is capped by net.core.wmem_max/rmem_max; raise
    net.ipv4.tcp_wmem/tcp_rmem instead for long fat paths.
    num_streams: a fixed count, or None (the default) to let a `StreamController` choose it
    from the path's queueing delay (WAN) or goodput (LAN), between 1 and `max_streams` (see
    transport/adaptive.py); `num_streams`, `controller.history` and the `prfaas_kv_streams`
    metric show the choice. `initial_streams`: where that controller starts (the scheduler's plan for
    the path's bandwidth-delay product; default 4), clamped to [1, `max_streams`].

    ssl_context: mutual TLS (transport/tls.py `client_context`). The receiver's certificate
    must name `server_hostname` when given (a decode region's `identity.server_name(region)`:
    every instance of the region shares that name, whatever its address), else the address
    dialled.

    A link that goes silent (a cut: no RST, no error) is waited out: a connection with bytes
    unacknowledged for `stall_timeout_s` is reset, the streams reconnect (backoff 0.1 s doubling
    to 2 s, jittered) for as long as it takes, and a transfer resumes from its acknowledged
    chunks on the first connection back, resending at most `max_inflight_bytes`; it fails only
    at its deadline (TIMEOUT). A receiver whose host answers and refuses (nothing listens,
    connections reset, TLS or HELLO refused) is gone with its copy of the shipment, so
    transfers fail with `PeerUnavailable` once every stream has been refused for
    `unavailable_after_s`, or at their deadline, whichever comes first.
    """

    def __init__(
        self,
        address: tuple[str, int],
        *,
        num_streams: int | None = None,
        max_streams: int = 64,
        initial_streams: int | None = None,
        max_inflight_bytes: int = 256 << 20,
        connect_timeout_s: float = 3.0,
        unavailable_after_s: float = 5.0,
        stall_timeout_s: float = 3.0,
        sock_buf_bytes: int | None = None,
        congestion_control: str | None = None,
        ssl_context: ssl.SSLContext | None = None,
        server_hostname: str | None = None,
        encode_threads: int = 2,
        node: str = "sender",
        dialer: Callable[[float], Any] | None = None,
    ) -> None:
        if num_streams is not None and not 1 <= num_streams <= 256:
            raise ValueError(f"num_streams must be in [1, 256], got {num_streams}")
        start = min(max_streams, max(1, initial_streams or 4))
        self.controller = None if num_streams is not None else StreamController(start, max_streams=max_streams)
        self.address = address
        self.connect_timeout_s = connect_timeout_s
        self.unavailable_after_s = unavailable_after_s
        self.stall_timeout_s = stall_timeout_s
        self.suspect_since = 0.0  # last time a connection stalled: a stream silent since sends only once heard
        self.sock_buf_bytes = sock_buf_bytes
        self.congestion_control = congestion_control
        self.ssl_context = ssl_context
        self.server_hostname = server_hostname  # what the receiver's certificate must name (TLS)
        self.node = node
        self.dialer = dialer  # (timeout_s) -> a connected socket-like stream; None: TCP to `address`
        self.peer = f"{address[0]}:{address[1]}"
        with _PEERS_LOCK:
            _OPEN_PEERS[self.peer] += 1
            self._counted = True
        self.closed = threading.Event()
        self.queue = SendQueue(max_inflight_bytes)
        self.table = TransferTable()
        self.meter = PathMeter()  # the path's figures, for the region's heartbeat (transport/pathmeter.py)
        self._encoder = encoder_pool(encode_threads, "prfaas-kv-encode")
        self._refused_since: float | None = None
        self._lock = threading.Lock()
        self._closing = False  # `close` began (under `_lock`): `submit` refuses
        self._next_index = 0
        self.streams: list[TcpStream] = []
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
                added.append(TcpStream(self, self._next_index))
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
        # Over TLS every record's AEAD tag authenticates the payload: no xxh3 of it (0 = none)
        tls = self.ssl_context is not None and self.dialer is None
        transfer = OutboundTransfer(shipment, self.queue.put, self._encoder, checksum_payload=not tls)
        with self._lock:  # `close` marks the channel closing under it, then cancels what the table holds
            if self._closing:
                raise PeerUnavailable("channel is closed")
            self.table.add(transfer)
        transfer.cell.on_terminal(lambda status: self._ended(transfer, status))
        any(stream.send_open(transfer) for stream in self.streams)  # first connected stream
        transfer.start()
        return transfer

    def _ended(self, transfer: OutboundTransfer, status: TransferStatus) -> None:
        metrics.TRANSFERS.labels(self.peer, status.value).inc()
        metrics.WIRE_BYTES.labels(self.peer).inc(transfer.stats.wire_bytes)
        metrics.RESENT_CHUNKS.labels(self.peer).inc(transfer.stats.resent_chunks)
        metrics.RESENT_BYTES.labels(self.peer).inc(transfer.stats.resent_bytes)
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
        # Whatever the outcome, its bytes no longer count against the in-flight budget, nor its chunks wait.
        self.queue.release(transfer.drop_unacked())
        self.queue.purge(transfer)

    def connect_ok(self, _stream: TcpStream) -> None:
        with self._lock:
            self._refused_since = None

    def connect_failed(self, stream: TcpStream, exc: Exception) -> None:
        """A refusal counts toward `unavailable_after_s`; silence does not (transfers wait for
        the link until their deadlines)."""
        log.debug("stream %d to %s failed to connect: %s", stream.index, self.address, exc)
        with self._lock:
            if any(s.connected.is_set() for s in self.streams):
                return
            if not refused(exc):
                self._refused_since = None
                return
            now = time.monotonic()
            self._refused_since = self._refused_since or now
            refused_for = now - self._refused_since
        if refused_for >= self.unavailable_after_s:
            for transfer in self.table.live():
                transfer.cell.finish(
                    TransferStatus.FAILED,
                    PeerUnavailable(
                        f"{self.address[0]}:{self.address[1]} refused every connection for {refused_for:.1f} s: {exc}"
                    ),
                )

    def _reap_loop(self) -> None:
        """Deadlines every 50 ms; every measurement window, the path's figures (`meter`) and,
        when the count is adaptive, the stream count."""
        window_start, samples, backlogged, demand = time.monotonic(), 0, 0, 0
        srtts: list[float] = []
        min_rtt: float | None = None
        # Goodput from the kernel's per-connection byte counts, not from chunk ACKs: on a slow
        # lossy path a stream completes a 1 MiB chunk every few seconds, so chunk ACKs per
        # window are a handful of bursts, not a rate.
        acked_at_start: dict[int, int] = {}
        acked_now: dict[int, int] = {}
        retrans_at_start: dict[int, int] = {}
        retrans_now: dict[int, int] = {}
        while not self.closed.wait(0.05):
            now = time.monotonic()
            for transfer in self.table.live():
                transfer.cell.expire_if_due(now)
            metrics.STREAMS.labels(self.peer).set(self.num_streams)
            metrics.STREAMS_CONNECTED.labels(self.peer).set(self.num_connected)
            infos = {s.index: i for s in self.streams if (i := s.tcp_info()) is not None}
            # the byte counts' time, for the window: a GIL wait before the reads (a busy host) must not
            # stretch the bytes over a shorter window (it read 99.5 Mbit/s on an 80 Mbit/s link in CI)
            read_at = time.monotonic()
            self._watch(now, infos)
            samples += 1
            # data waits for the path: chunks queued for a stream, or bytes unsent in most streams' sockets.
            # Not in any one socket: a shipment's tail on a few of many streams, or an encoder that feeds
            # only some of them (the CPU is the limit), left the rest idle and read as a full path, and the
            # controller climbed to 32-64 streams (kvw4 on the intercontinental bench: 3.3x at 4 streams,
            # 2.4x at 32; docs/benchmarks.md)
            waiting = sum(1 for i in infos.values() if i.notsent_bytes > 0)
            full_now = self.queue.backlogged() or (bool(infos) and 2 * waiting >= len(infos))
            backlogged += int(full_now)
            # or the sender's own CPU: layers wait to be encoded. Either way this count's goodput is what the
            # channel can deliver (the controller judges its last step by it); a shipment's tail is neither
            demand += int(full_now or any(t.encoding_backlog for t in self.table.live()))
            srtts += [i.srtt_s for i in infos.values()]  # every 50 ms: CUBIC's queue swings within a window
            min_rtt = min((i.min_rtt_s for i in infos.values()), default=min_rtt)
            for index, info in infos.items():
                if acked_now.get(index, 0) > info.bytes_acked:  # a reconnected stream: a new count
                    acked_at_start[index], retrans_at_start[index] = 0, 0
                acked_now[index], retrans_now[index] = info.bytes_acked, info.total_retrans
            window_s = self.controller.window_s(min_rtt) if self.controller else max(0.5, 8 * (min_rtt or 0.0))
            if read_at - window_start < window_s:
                continue
            acked = sum(n - acked_at_start.get(i, 0) for i, n in acked_now.items())
            path = PathSample(statistics.median(srtts), min_rtt) if srtts and min_rtt is not None else None
            full = backlogged >= 0.8 * samples
            self.meter.add(read_at - window_start, acked, backlogged=full, srtt_s=path.srtt_s if path else None,
                           min_rtt_s=min_rtt, retransmits=sum(max(0, n - retrans_at_start.get(i, 0))
                                                              for i, n in retrans_now.items()))  # fmt: skip
            if path is not None:
                metrics.QUEUEING_DELAY.labels(self.peer).set(max(0.0, path.srtt_s - path.min_rtt_s))
            if self.controller is not None:
                rate = acked / (read_at - window_start)
                count = self.controller.update(now, rate, backlogged=full, path=path, waiting=demand >= 0.8 * samples)
                if count != self.num_streams:
                    log.info(
                        "streams to %s: %d -> %d (%.1f MB/s, queueing %s)", self.address, self.num_streams, count,
                        rate / 1e6, f"{1e3 * (path.srtt_s - path.min_rtt_s):.1f} ms" if path else "unknown",
                    )  # fmt: skip
                    self.resize(count)
            live = {s.index for s in self.streams}
            acked_at_start = {i: n for i, n in acked_now.items() if i in live}
            acked_now = dict(acked_at_start)
            retrans_at_start = {i: n for i, n in retrans_now.items() if i in live}
            retrans_now = dict(retrans_at_start)
            window_start, samples, backlogged, demand, srtts = read_at, 0, 0, 0, []

    def _watch(self, now: float, infos: dict[int, TcpInfo]) -> None:
        """Reset connections whose path went silent; ping quiet ones (TcpStream.watch)."""
        with self._lock:
            streams = list(self.streams)
        for stream in streams:
            if stream.watch(now, infos.get(stream.index), self.stall_timeout_s):
                log.warning("stream %d to %s: no ACK for %.1f s, reconnecting", stream.index, self.peer,
                            self.stall_timeout_s)  # fmt: skip
                metrics.STALLS.labels(self.peer).inc()
                self.suspect_since = now  # the others may be on the same dead path: they ping first
                stream.kill(silent=True)

    @property
    def num_connected(self) -> int:
        return sum(1 for s in self.streams if s.connected.is_set())

    def close(self, timeout_s: float = 5.0) -> None:
        """Cancel live transfers, close every connection, join every thread; all within `timeout_s` (a thread
        still running then is a daemon stuck in a call that has its own bound)."""
        end = time.monotonic() + timeout_s
        with self._lock:
            self._closing = True  # no submit gets into the table from now on
        for transfer in self.table.live():
            transfer.cancel()
        with self._lock:
            streams = list(self.streams)
        cancels_end = time.monotonic() + min(1.0, timeout_s)  # their CANCELs out first, where a path takes them
        while any(s.connected.is_set() and s.has_control() for s in streams) and time.monotonic() < cancels_end:
            time.sleep(0.005)
        self.closed.set()
        self.queue.close()
        with self._lock:
            streams = list(self.streams)
        for stream in streams:
            stream.kill()
        for stream in streams:
            stream.thread.join(max(0.0, end - time.monotonic()))
        self._reaper.join(max(0.0, end - time.monotonic()))
        self._encoder.shutdown(wait=True, cancel_futures=True)
        with _PEERS_LOCK:  # its figures go with the last channel to the peer (not kept for good)
            if not self._counted:  # closed before
                return
            self._counted = False
            _OPEN_PEERS[self.peer] -= 1
            if _OPEN_PEERS[self.peer] <= 0:
                del _OPEN_PEERS[self.peer]
                for gauge in (metrics.STREAMS, metrics.STREAMS_CONNECTED, metrics.QUEUEING_DELAY):
                    with contextlib.suppress(KeyError):
                        gauge.remove(self.peer)

    def __enter__(self) -> TcpChannel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
