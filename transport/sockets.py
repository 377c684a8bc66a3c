"""Socket options both ends of a KV connection use, and what the kernel reports about one."""

from __future__ import annotations

import contextlib
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from prfaas.transport.tls import TlsSocket

# Pooled connections sit idle between jobs and their readers block without a timeout, so a
# peer that vanished without a FIN is found by keepalive: 30 s idle + 3 probes 10 s apart.
KEEPALIVE_IDLE_S = 30
KEEPALIVE_INTERVAL_S = 10
KEEPALIVE_PROBES = 3


def configure(sock: socket.socket, buf_bytes: int | None = None) -> None:
    """No Nagle delay, keepalive that reaps dead peers within ~60 s, optional fixed buffers."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    if hasattr(socket, "TCP_KEEPIDLE"):  # Linux
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, KEEPALIVE_IDLE_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, KEEPALIVE_INTERVAL_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, KEEPALIVE_PROBES)
    if buf_bytes:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buf_bytes)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buf_bytes)


@dataclass(frozen=True)
class TcpInfo:
    srtt_s: float  # tcpi_rtt: smoothed RTT
    min_rtt_s: float  # tcpi_min_rtt: lowest RTT seen (windowed by the kernel)
    bytes_acked: int  # tcpi_bytes_acked: payload bytes the peer's TCP acknowledged
    notsent_bytes: int  # tcpi_notsent_bytes: in the socket buffer, not yet sent (the path is the limit)
    unacked: int = 0  # tcpi_unacked: segments sent and not yet acknowledged
    total_retrans: int = 0  # tcpi_total_retrans: segments retransmitted over the connection's life


def tcp_info(sock: socket.socket | TlsSocket) -> TcpInfo | None:
    """The kernel's TCP_INFO for a connection (Linux struct tcp_info offsets), or None before
    its first RTT sample, off Linux, or on a closed socket."""
    if not hasattr(socket, "TCP_INFO"):
        return None
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 152)
    except OSError:
        return None
    if len(info) < 152:
        return None
    srtt_us, min_rtt_us = struct.unpack_from("<I", info, 68)[0], struct.unpack_from("<I", info, 148)[0]
    if not srtt_us or not min_rtt_us or min_rtt_us == 0xFFFFFFFF:  # no RTT sample yet
        return None
    bytes_acked, notsent = struct.unpack_from("<Q", info, 120)[0], struct.unpack_from("<I", info, 144)[0]
    unacked, total_retrans = struct.unpack_from("<I", info, 24)[0], struct.unpack_from("<I", info, 100)[0]
    return TcpInfo(srtt_us / 1e6, min_rtt_us / 1e6, bytes_acked, notsent, unacked, total_retrans)


# A sender socket takes more data only while less than this is waiting unsent in it, so
# chunks stay in the channel's queue, where any stream can take them, instead of piling
# up behind one stream that a loss has stalled (TCP_NOTSENT_LOWAT, Linux >= 3.12).
NOTSENT_LOWAT_BYTES = 1 << 20
TCP_NOTSENT_LOWAT = getattr(socket, "TCP_NOTSENT_LOWAT", 25)


def limit_unsent(sock: socket.socket | TlsSocket, lowat: int = NOTSENT_LOWAT_BYTES) -> None:
    """Only for WAN paths: on loopback, one quick test gave 2.0-2.3 GB/s with it against 3.2-5.1
    without (runs at different host loads, so not a clean ratio); a LAN needs no such limit."""
    with contextlib.suppress(OSError):  # not Linux: the socket buffer bounds it instead
        sock.setsockopt(socket.IPPROTO_TCP, TCP_NOTSENT_LOWAT, lowat)


# A send that makes no progress this long (the peer stopped reading, or both ends are
# writing and neither reads) fails instead of blocking its thread, and the locks it holds,
# forever; the connection is then dropped and its chunks resent. Far above any stall of a
# live path: the window of a 300 Mbit/s, 0.1 %-loss WAN path opens within a few RTTs.
SEND_TIMEOUT_S = 10.0


def send_timeout(sock: socket.socket | TlsSocket, timeout_s: float) -> None:
    """Bound every blocking send on `sock` (SO_SNDTIMEO) while reads may still block: a send
    that makes no progress for `timeout_s` raises BlockingIOError (an OSError) instead of
    waiting forever on a peer that stopped reading."""
    seconds = int(timeout_s)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", seconds, int((timeout_s - seconds) * 1e6)))


DRAIN_PIECE_BYTES = 64 << 10  # what one send of a drain takes (under TLS: one record write), bounded by the time left


def sendall_by(raw: socket.socket, sendall: Callable[[bytes], object], data: bytes, deadline: float) -> None:
    """`sendall(data)` for a drain before a close, never past `deadline` (time.monotonic(); else TimeoutError):
    `raw`'s timeout, capped at the time left, bounds each piece's send (`sendall` may be a TLS socket's over
    `raw`: the send of its records), and is put back after. The send timeout alone (SO_SNDTIMEO) would let
    one send wait on a peer that stopped reading for seconds. The connection closes next, so a frame cut short
    here, or a reader of `raw` woken by the timeout meanwhile, ends nothing that was not ending."""
    before = raw.gettimeout()
    try:
        for start in range(0, len(data), DRAIN_PIECE_BYTES):
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the peer took too little of what was queued before close")
            raw.settimeout(left)
            sendall(data[start : start + DRAIN_PIECE_BYTES])
    finally:
        with contextlib.suppress(OSError):
            raw.settimeout(before)


def send_frame(sock: socket.socket | TlsSocket, header: bytes, payload: bytes | memoryview) -> None:
    """Send a frame's header and payload with one gathering syscall where the kernel takes it
    all (no copy into a joined buffer); the rest goes out with `sendall`."""
    if not isinstance(sock, socket.socket):  # TlsSocket: no scatter-gather
        sock.sendall(header)
        sock.sendall(payload)
        return
    sent = sock.sendmsg([header, payload])
    if sent < len(header):
        sock.sendall(memoryview(header)[sent:])
        sent = len(header)
    if sent - len(header) < len(payload):
        sock.sendall(memoryview(payload)[sent - len(header) :])
