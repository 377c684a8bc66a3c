"""`FrameWriter`: whole frames onto one byte stream from many threads, where one peer that stops reading
must not hold up the threads that only tell it something ended.

`write` is for the thread that serves the connection: it waits its turn and sends (bounded by the socket's
send timeout; raises OSError). `post` is for every other thread (a receiver's reaper ending a shipment at
its deadline, the decode engine canceling one, `close`): it never waits. The frame goes out now when no
write is in progress and the socket has room, else it stays queued: the write in progress (or the next one)
sends it first, and so does `flush`, which the owner's reaper calls every tick (a peer that stopped reading
for a while gets it once it reads again, even if nothing else is written), and `drain`, bounded, before the
connection is closed. Frames keep the order they were handed in: queued ones go before a later write.
"""

from __future__ import annotations

import contextlib
import select
import threading
import time
from collections.abc import Callable

Buffer = bytes | bytearray | memoryview
DRAIN_POLL_S = 0.005  # how often `drain` looks for room in a full socket


def socket_room(fileno: Callable[[], int]) -> Callable[[], bool]:
    """Whether the socket `fileno()` names can take a write now without waiting (POLLOUT); a closed one
    (-1, or an error) says yes, and its send then fails at once."""

    def room() -> bool:
        try:
            fd = fileno()
        except (OSError, AttributeError, ValueError):
            return True
        if fd < 0:
            return True
        poller = select.poll()  # (select.select cannot take a descriptor past 1023)
        poller.register(fd, select.POLLOUT)
        with contextlib.suppress(OSError, ValueError):
            return bool(poller.poll(0))
        return True

    return room


class FrameWriter:
    """`send(data, payload)` writes both whole, in order (raises OSError; sockets.py `send_frame`);
    `room()` says whether a write would go out without waiting (`socket_room`); `on_error` ends the
    connection when a posted frame's send failed (part of it may be out). `send_by(data, deadline)`, for
    `drain`: a send that gives up at `deadline` (time.monotonic(); raises OSError), part of `data` out or
    not (room for a few bytes says nothing of room for all); None: `send`, bounded by the socket's send
    timeout only."""

    def __init__(
        self,
        send: Callable[[bytes, Buffer], None],
        room: Callable[[], bool],
        on_error: Callable[[OSError], None],
        send_by: Callable[[bytes, float], None] | None = None,
    ) -> None:
        self.lock = threading.Lock()  # held by every send (a caller writing around `write` takes it too)
        self._send = send
        self._send_by = send_by
        self._room = room
        self._on_error = on_error
        self._queued: list[bytes] = []
        self._queued_lock = threading.Lock()

    def write(self, data: bytes, payload: Buffer = b"") -> None:
        """Send `data` (and `payload`, a frame's body, not copied) after anything queued, waiting for the
        lock (raises OSError)."""
        with self.lock:
            self._send(self._take() + data, payload)
        self.flush()

    def post(self, data: bytes) -> None:
        """Send `data` now if that cannot wait on the peer, else leave it for the next write or `flush`. Never
        raises."""
        with self._queued_lock:
            self._queued.append(data)
        self.flush()

    @property
    def queued(self) -> int:
        with self._queued_lock:
            return len(self._queued)

    def _take(self) -> bytes:
        with self._queued_lock:
            data, self._queued = b"".join(self._queued), []
        return data

    def drain(self, deadline: float) -> None:
        """Queued frames out before the connection is closed (the CANCELs of shipments a closing receiver
        ended): waits for a write in progress and for the socket's room, but never past `deadline`
        (time.monotonic()) where the owner gave `send_by`; a peer that does not read by then does not get them."""
        while self.queued:
            left = deadline - time.monotonic()
            if left <= 0 or not self.lock.acquire(timeout=left):
                return
            try:
                if self._room():
                    data = self._take()
                    if data and self._send_by is not None:
                        self._send_by(data, deadline)  # a failure ends the connection, which closes next anyway
                    elif data:
                        self._send(data, b"")
                    continue
            except OSError as exc:
                self._on_error(exc)
                return
            finally:
                self.lock.release()
            time.sleep(min(DRAIN_POLL_S, max(0.0, deadline - time.monotonic())))

    def flush(self) -> None:
        """Queued frames out, if the lock is free and the socket has room; never waits. Whoever releases the
        lock checks again, so a frame queued while another thread held it is not left behind."""
        while self.queued and self.lock.acquire(blocking=False):
            try:
                if not self._room():
                    return  # the peer does not read: the next write or flush (each reaper tick) takes them
                data = self._take()
                if data:
                    self._send(data, b"")
            except OSError as exc:
                self._on_error(exc)
                return
            finally:
                self.lock.release()
