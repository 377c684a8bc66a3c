"""What a KV receiver lets a connection do before and after it has proven itself.

A connection is **verified** once it is known to come from a prefill region: over TLS, when
its certificate names a prefill-serving identity (transport/identity.py) and it said HELLO;
in plaintext, once an OPEN on it carried a ticket that verifies (signature, expiry, job).
Until then it is **unverified**, and the receiver keeps it cheap and short-lived:

- `handshake_timeout_s`: the TLS handshake and a HELLO must be done this long after the
  connection was accepted, or it is closed (a connection that says nothing ties up nothing
  for long). A plaintext connection that said HELLO but has carried no ticket yet is a
  sender's idle pooled stream as often as not: it stays, but counts as unverified.
- `max_unverified`: at most this many unverified connections at once. A new connection
  beyond it evicts the oldest unverified one rather than being refused: a flood of junk
  connections then cannot lock a real sender out (per-address caps would lock out a real
  prefill region behind the same NAT or on the same host as the attacker); it only shortens
  the time a new connection has to prove itself. Verified connections are never evicted.
- `max_connections`: at most this many connections in all; beyond it a new connection
  evicts the oldest unverified one, or is closed at once if every connection is verified.
- `max_per_peer`: at most this many verified connections from one peer (over TLS the
  identity its certificate names, in plaintext its address: a peer that verified holds a
  ticket, so no stranger shares its count). The newest beyond it are closed within one reap
  interval: one compromised or runaway prefill instance cannot take every slot.
- Frame sizes (a header is checked before any byte of its payload is read, and no payload
  buffer is ever sized by a header the receiver has not authenticated): before HELLO at most
  `max_hello_bytes`; control frames (OPEN, CANCEL, PING, ERROR) at most `max_control_bytes`;
  DATA at most the largest `chunk_bytes` of an OPEN accepted on this connection (the
  negotiated chunk size; `max_control_bytes` before any). DATA the receiver does not store
  (unknown or ended shipments, duplicates) is read past through a small scratch buffer.

Over-limit frames are answered `ERROR BAD_FRAME` and the connection is closed.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from prometheus_client import Counter

from prfaas.transport.errors import FrameError
from prfaas.transport.framing import FrameType, Header, Readable

log = logging.getLogger(__name__)
SCRATCH_BYTES = 64 << 10  # what an unwanted payload is read through, a piece at a time

REFUSED = Counter(
    "prfaas_kv_connections_refused_total",
    "KV connections a receiver closed before they proved themselves, by reason",
    ["reason"],  # over_capacity, evicted, handshake_timeout, frame_too_large, peer_identity, per_peer
)


@dataclass(frozen=True)
class ReceiverLimits:
    """A receiver's connection limits (module docstring). Units: connections, seconds, bytes."""

    max_connections: int = 1024  # in all; 64 streams from each of 16 prefill regions
    max_unverified: int = 128  # not yet proven (TLS handshake, HELLO, plaintext without a ticket)
    max_per_peer: int = 256  # verified, from one prefill instance (its channels' streams, with room)
    handshake_timeout_s: float = 2.0  # accept -> TLS handshake and HELLO done
    max_hello_bytes: int = 4 << 10  # any frame before HELLO (a HELLO is ~60 bytes)
    max_control_bytes: int = 64 << 10  # OPEN (a 200-layer OPEN is ~4 KB), CANCEL, PING, ERROR

    def __post_init__(self) -> None:
        if not 1 <= self.max_unverified <= self.max_connections:
            raise ValueError(f"need 1 <= max_unverified ({self.max_unverified}) <= max_connections "
                             f"({self.max_connections})")  # fmt: skip
        if self.max_per_peer < 1:
            raise ValueError(f"max_per_peer must be >= 1, got {self.max_per_peer}")
        if self.handshake_timeout_s <= 0:
            raise ValueError(f"handshake_timeout_s must be > 0, got {self.handshake_timeout_s}")
        if not 64 <= self.max_hello_bytes <= self.max_control_bytes:
            raise ValueError(f"need 64 <= max_hello_bytes ({self.max_hello_bytes}) <= max_control_bytes "
                             f"({self.max_control_bytes})")  # fmt: skip

    def payload_limit(self, header: Header, *, hello: bool, chunk_bytes: int) -> int:
        """The most payload bytes a frame like `header` may carry on a connection that has
        (`hello`) or has not said HELLO, whose accepted OPENs negotiated `chunk_bytes` (0: none)."""
        if not hello:
            return self.max_hello_bytes
        if header.type is FrameType.DATA:
            return max(chunk_bytes, self.max_control_bytes)
        return self.max_control_bytes

    def check(self, header: Header, *, hello: bool, chunk_bytes: int) -> Header:
        """`header`, or FrameError if its payload is over the limit (the connection must close)."""
        limit = self.payload_limit(header, hello=hello, chunk_bytes=chunk_bytes)
        if header.payload_len > limit:
            REFUSED.labels("frame_too_large").inc()
            state = "before HELLO" if not hello else "on this connection"
            raise FrameError(f"{header.type.name} payload of {header.payload_len} bytes exceeds the "
                             f"{limit}-byte limit {state}")  # fmt: skip
        return header


class Throttled:
    """A warning at most every `interval_s` (floods must not flood the log), with a count."""

    def __init__(self, interval_s: float = 10.0) -> None:
        self.interval_s = interval_s
        self._last = 0.0
        self._count = 0

    def warn(self, message: str, *args: object) -> None:
        self._count += 1
        now = time.monotonic()
        if now - self._last >= self.interval_s:
            log.warning(message + " (%d such since the last warning)", *args, self._count)
            self._last, self._count = now, 0


def discard(sock: Readable, nbytes: int, scratch: bytearray) -> None:
    """Read `nbytes` past, through `scratch` (ConnectionError if the peer closes first)."""
    view = memoryview(scratch)
    while nbytes > 0:
        n = sock.recv_into(view, min(nbytes, len(view)))
        if n == 0:
            raise ConnectionError(f"connection closed with {nbytes} payload bytes unread")
        nbytes -= n
