"""What every receiver is built on, whatever carries its frames (TCP, shared memory, WebRTC).

A receiver keeps a `ReceiverCore` (the protocol rules), the connections it accepted, each
read by its own thread (`FrameConnection`: frames in, handed to the core; replies written
under a per-connection lock), and a reaper thread that ends shipments at their deadline and
closes connections past their handshake deadline. What a connection may do before it has
proven itself (caps, deadline, frame sizes) is `ReceiverLimits` (transport/admission.py).
`ListeningReceiver` adds a listening socket and the thread that accepts from it.
`close()` stops and joins every thread the receiver started.
"""

from __future__ import annotations

import contextlib
import enum
import socket
import threading
import time
from collections.abc import Callable
from typing import Generic, Protocol, Self, TypeVar, cast

from prfaas.transport import sockets
from prfaas.transport.admission import REFUSED, SCRATCH_BYTES, ReceiverLimits, Throttled, discard
from prfaas.transport.errors import FrameError
from prfaas.transport.framing import (
    HEADER_SIZE,
    ErrorCode,
    Frame,
    FrameType,
    Header,
    encode,
    error_frame,
    parse_header,
    payload_ok,
    read_exact,
    read_into,
    to_frame,
)
from prfaas.transport.inbound import Inbound
from prfaas.transport.receiver_core import Discard, ReceiverCore, Session
from prfaas.transport.writer import FrameWriter, socket_room

Payload = bytes | bytearray | memoryview
DRAIN_S = 1.0  # what `close` waits, at most, for frames still queued to its peers


class ByteStream(Protocol):
    """A connected socket, a `TlsSocket` or a WebRTC `DataChannelStream`."""

    def recv_into(self, buffer: memoryview, nbytes: int = ..., /) -> int: ...
    def sendall(self, data: bytes, /) -> None: ...
    def shutdown(self, how: int, /) -> None: ...
    def close(self) -> None: ...


class FrameConnection:
    """One accepted connection: its thread reads frames and hands them to the core; replies
    (and the core's own DONE / CANCEL / ERROR, through `session`) go back under one lock.
    A failed send closes the connection: its reader then ends, and the sender resends the
    unacknowledged chunks on another."""

    thread_name = "prfaas-kv-conn"

    def __init__(self, sock: ByteStream, core: ReceiverCore, limits: ReceiverLimits) -> None:
        self.raw = sock  # what `close` shuts down (under TLS, the socket beneath `sock`)
        self.sock = sock
        self.core = core
        self.limits = limits
        self.accepted_at = time.monotonic()
        self.writer = FrameWriter(self._sendall, self._room(), lambda _exc: self.close(), send_by=self._sendall_by)
        self._write_lock = self.writer.lock
        self._scratch: bytearray | None = None  # what unwanted payloads are read through
        self.session = Session(self.send, self.abort)
        self.thread = threading.Thread(target=self._run, name=self.thread_name, daemon=True)

    def send(self, frame: Frame) -> None:
        """A reply from this connection's thread; from any other (a shipment ended by the reaper, the decode
        engine, close) a frame that never waits on this peer (transport/writer.py)."""
        if threading.current_thread() is self.thread:
            self.write(encode(frame))
        else:
            self.writer.post(encode(frame))

    def write(self, data: bytes) -> None:
        """Send encoded frames whole, or end the connection."""
        try:
            self.writer.write(data)
        except OSError:  # broken, or a sender that stopped reading (part of a frame may be out)
            self.close()  # the reader then ends the connection; the sender resends on another

    def _sendall(self, data: bytes, _payload: bytes | bytearray | memoryview) -> None:
        self.sock.sendall(data)  # a receiver's frames are whole in `data`

    def _sendall_by(self, data: bytes, deadline: float) -> None:
        """`_sendall` for a drain before `close`, never past `deadline` (sockets.py `sendall_by`)."""
        raw = self.raw
        if not isinstance(raw, socket.socket):  # a stream of its own (WebRTC), waiting on its own terms
            self._sendall(data, b"")
            return
        sockets.sendall_by(raw, self.sock.sendall, data, deadline)

    def _room(self) -> Callable[[], bool]:
        """Whether a write to this peer would go out now: the socket's POLLOUT, or the stream's own say."""
        writable = getattr(self.raw, "writable", None)
        if callable(writable):
            return cast("Callable[[], bool]", writable)
        return socket_room(getattr(self.raw, "fileno", lambda: -1))

    def _run(self) -> None:
        try:
            self.serve()
        except FrameError as exc:
            self.send(error_frame(ErrorCode.BAD_FRAME, str(exc)))
        except (OSError, ConnectionError):
            pass
        finally:
            self.writer.flush()  # frames other threads posted meanwhile (never waits)
            self.close()

    def serve(self) -> None:
        """Read frames and answer each until the connection ends (by raising)."""
        while True:
            for reply in self.receive(self.next_header()):
                self.send(reply)

    def next_header(self) -> Header:
        """The next frame's header, checked against the limits before its payload is read."""
        session = self.session
        header = parse_header(read_exact(self.sock, HEADER_SIZE))
        return self.limits.check(header, hello=session.hello, chunk_bytes=session.chunk_bytes)

    def receive(self, header: Header) -> list[Frame]:
        """The frame whose header was just read: its payload, then the core's replies. KV goes
        from the socket straight into its layer buffer when the core has one for it; a payload
        nothing wants is read past, never into memory sized by its header."""
        if header.type is FrameType.DATA and header.payload_len:
            slot = self.core.data_slot(header, self.session)
            if isinstance(slot, Discard):
                self._scratch = self._scratch or bytearray(min(SCRATCH_BYTES, self.limits.max_control_bytes))
                discard(self.sock, header.payload_len, self._scratch)
                return slot.replies
            if slot is not None:
                try:
                    read_into(self.sock, slot)
                except BaseException:
                    self.core.data_commit(header, False, self.session)  # release the claim
                    raise
                return self.core.data_commit(header, self.verify(header, slot), self.session)
        payload = read_exact(self.sock, header.payload_len) if header.payload_len else bytearray()
        replies = self.core.handle(to_frame(header, payload), self.verify(header, payload), self.session)
        return self.handled(header, payload, replies)

    def verify(self, header: Header, payload: Payload) -> bool:
        """Whether the payload matches its checksum."""
        return payload_ok(header, payload)

    def handled(self, header: Header, payload: bytearray, replies: list[Frame]) -> list[Frame]:
        """What to send back for a frame the core handled whole (a subclass may add to it)."""
        return replies

    def abort(self) -> None:
        """End the connection from another thread: its reader wakes, and closes it."""
        with contextlib.suppress(OSError):
            self.raw.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.abort()
        self.raw.close()


C = TypeVar("C", bound=FrameConnection)


class Admission(enum.Enum):
    ADMITTED = "admitted"
    REFUSED = "refused"  # over `max_connections`, every connection verified
    CLOSING = "closing"  # the receiver is closing


class Connections(Generic[C]):
    """The connections a receiver accepted (each served by its own thread) and a reaper thread
    that ends shipments past their deadline and connections past their handshake deadline.
    `add` admits within `limits` (transport/admission.py), and refuses all once `closing()` began."""

    def __init__(self, core: ReceiverCore, reap_interval_s: float, reaper_name: str, limits: ReceiverLimits) -> None:
        self.closed = threading.Event()
        self._core = core
        self._interval_s = reap_interval_s
        self._limits = limits
        self._lock = threading.Lock()
        self._items: list[C] = []
        self._warn = Throttled()
        self.reaper = threading.Thread(target=self._reap, name=reaper_name, daemon=True)
        self.reaper.start()

    def add(self, connection: C) -> Admission:
        """Keep `connection` (and drop the finished ones) within the limits: past them the
        oldest unverified connection is evicted, or, when every one is verified, `connection`
        is refused (the caller closes it)."""
        limits = self._limits
        with self._lock:
            if self.closed.is_set():
                return Admission.CLOSING
            self._items = [c for c in self._items if c.thread.is_alive()]
            unverified = [c for c in self._items if not c.session.verified]
            if len(self._items) >= limits.max_connections or len(unverified) >= limits.max_unverified:
                if not unverified:
                    REFUSED.labels("over_capacity").inc()
                    self._warn.warn("KV receiver at %d connections, all verified: refusing more", len(self._items))
                    return Admission.REFUSED
                oldest = unverified[0]  # the longest given to prove itself
                self._items.remove(oldest)
                oldest.abort()
                REFUSED.labels("evicted").inc()
                self._warn.warn("KV receiver full of unverified connections: closing the oldest")
            self._items.append(connection)
            return Admission.ADMITTED

    @property
    def live(self) -> int:
        with self._lock:
            return sum(1 for c in self._items if c.thread.is_alive())

    def closing(self) -> list[C]:
        """Refuse new connections; the ones kept so far, for the receiver to close."""
        self.closed.set()
        with self._lock:
            return list(self._items)

    def _reap(self) -> None:
        while not self.closed.wait(self._interval_s):
            with self._lock:
                items = list(self._items)
            for connection in items:  # end frames posted while a peer did not read: out once it does
                connection.writer.flush()
            self._core.expire_due()
            self._end_late_handshakes()
            self._cap_peers()

    def _end_late_handshakes(self) -> None:
        """Close connections that have not said HELLO (over TLS: finished the handshake with a
        prefill identity, then HELLO) within the handshake deadline."""
        cutoff = time.monotonic() - self._limits.handshake_timeout_s
        with self._lock:
            late = [c for c in self._items if not c.session.hello and c.accepted_at < cutoff]
        for connection in late:
            REFUSED.labels("handshake_timeout").inc()
            connection.abort()

    def _cap_peers(self) -> None:
        """Close the newest verified connections of a peer past `max_per_peer` (its oldest
        carry its pooled streams)."""
        by_peer: dict[str, list[C]] = {}
        with self._lock:
            for c in self._items:
                if c.session.peer and c.session.verified and c.thread.is_alive():
                    by_peer.setdefault(c.session.peer, []).append(c)
        for peer, connections in by_peer.items():
            for connection in connections[self._limits.max_per_peer :]:
                REFUSED.labels("per_peer").inc()
                self._warn.warn("KV peer %s over %d connections: closing its newest", peer, self._limits.max_per_peer)
                connection.abort()


class ReceiverBase(Generic[C]):
    """A receiver's core, its connections and its reaper; `name` names their threads.

    owns_core: whether `close` cancels the core's expected shipments (False when the core is
    shared with another receiver, which cancels them itself)."""

    def __init__(self, core: ReceiverCore, *, name: str, reap_interval_s: float, owns_core: bool = True,
                 limits: ReceiverLimits | None = None) -> None:  # fmt: skip
        self.core = core
        self.limits = limits or ReceiverLimits()
        self._owns_core = owns_core
        self._connections: Connections[C] = Connections(core, reap_interval_s, f"prfaas-{name}-reaper", self.limits)

    def expect(
        self, job_id: str, attempt: int, timeout_s: float, *, tenant: str | None = None, max_bytes: int | None = None
    ) -> Inbound:
        """Register a shipment this receiver holds room for; KV for anything else is refused
        (`Receiver.expect`: `tenant` and `max_bytes` are checked at OPEN)."""
        return self.core.expect(job_id, attempt, timeout_s, tenant=tenant, max_bytes=max_bytes)

    @property
    def num_connections(self) -> int:
        return self._connections.live

    def serve(self, connection: C) -> bool:
        """Start serving `connection` if the limits admit it (else it is closed); False once
        the receiver is closing."""
        admission = self._connections.add(connection)
        if admission is not Admission.ADMITTED:
            connection.close()
            return admission is not Admission.CLOSING
        connection.thread.start()
        return True

    def close(self, timeout_s: float = 5.0) -> None:
        """Cancel expected shipments, stop accepting, close connections, join threads."""
        if self._owns_core:
            self.core.cancel_all("receiver shutting down")
        connections = self._connections.closing()
        self._stop_accepting()
        # The CANCELs cancel_all posted, out first: one left queued behind a write in progress (an ACK) would
        # go down with the socket, and its sender learn only from the lost connection, seconds later.
        drained_by = time.monotonic() + min(DRAIN_S, timeout_s)  # for all connections together
        for connection in connections:
            connection.writer.drain(drained_by)
            connection.close()
        threads = [*self._threads(), self._connections.reaper, *(c.thread for c in connections)]
        for thread in threads:
            if thread.is_alive() and thread is not threading.current_thread():
                thread.join(timeout_s)
        self._release(timeout_s)

    def _stop_accepting(self) -> None:
        """Accept no more connections (wake the thread that accepts them)."""

    def _threads(self) -> list[threading.Thread]:
        """Threads of the receiver's own, besides the reaper and the connections'."""
        return []

    def _release(self, timeout_s: float) -> None:
        """Free what the receiver holds once every thread is joined."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ListeningReceiver(ReceiverBase[C]):
    """A receiver that accepts connections on a listening socket, in a thread of its own;
    `connection(sock)` prepares each accepted socket and wraps it."""

    def __init__(self, listener: socket.socket, core: ReceiverCore, *, name: str, reap_interval_s: float,
                 owns_core: bool = True, limits: ReceiverLimits | None = None) -> None:  # fmt: skip
        super().__init__(core, name=name, reap_interval_s=reap_interval_s, owns_core=owns_core, limits=limits)
        self._listener = listener
        self._acceptor = threading.Thread(target=self._accept_loop, name=f"prfaas-{name}-accept", daemon=True)
        self._acceptor.start()

    def connection(self, sock: socket.socket) -> C:
        raise NotImplementedError

    def _accept_loop(self) -> None:
        while not self._connections.closed.is_set():
            try:
                sock, _peer = self._listener.accept()
            except OSError:
                if self._connections.closed.is_set():
                    return  # listener closed
                time.sleep(0.05)  # out of file descriptors or memory: a flood must not end accepting
                continue
            if not self.serve(self.connection(sock)):
                return

    def _stop_accepting(self) -> None:
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked in accept()
        self._listener.close()

    def _threads(self) -> list[threading.Thread]:
        return [self._acceptor]
