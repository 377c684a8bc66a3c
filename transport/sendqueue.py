"""The sender's queue of chunks: earliest deadline first, bounded bytes in flight."""

from __future__ import annotations

import heapq
import threading
import time
from collections.abc import Callable

from prfaas.transport.outbound import Chunk


class SendQueue:
    """Chunks waiting to be sent, earliest deadline first, with an in-flight byte budget."""

    def __init__(self, max_inflight_bytes: int) -> None:
        self._heap: list[tuple[tuple[float, int], Chunk]] = []
        self._cond = threading.Condition()
        self._inflight = 0
        self._max_inflight = max_inflight_bytes
        self.closed = False

    def put(self, chunks: list[Chunk]) -> None:
        """Queue `chunks`; those of an ended transfer are dropped (`purge` took its others out)."""
        with self._cond:
            for chunk in chunks:
                if not chunk.queued and not chunk.transfer.cell.status().terminal:
                    chunk.queued = True
                    heapq.heappush(self._heap, (chunk.order, chunk))
            self._cond.notify_all()

    def purge(self, transfer: object) -> None:
        """Take an ended transfer's chunks out of the queue (with no connection, no `get` would ever pop them:
        they held the transfer, its producer's buffers and the encoded bytes)."""
        with self._cond:
            kept = [entry for entry in self._heap if entry[1].transfer is not transfer]
            if len(kept) != len(self._heap):
                for entry in self._heap:
                    if entry[1].transfer is transfer:
                        entry[1].queued = False
                heapq.heapify(kept)
                self._heap = kept

    def get(self, timeout_s: float, interrupt: Callable[[], bool] | None = None, *, stream: int) -> Chunk | None:
        """The next chunk of a live transfer, once the in-flight budget allows, now `stream`'s (`chunk.stream`,
        set here: a broken stream takes back only what no other stream took since, `requeue_lost`); None on
        timeout, or as soon as `interrupt()` is true after a `wake`."""
        end = time.monotonic() + timeout_s
        with self._cond:
            while not self.closed and not (interrupt is not None and interrupt()):
                while self._heap and (self._heap[0][1].acked or self._heap[0][1].transfer.cell.status().terminal):
                    heapq.heappop(self._heap)[1].queued = False  # dropped with its transfer, or it arrived meanwhile
                # never past the budget (but one chunk always goes): unacknowledged bytes, all a
                # broken path can make the channel send again, stay within max_inflight_bytes
                if self._heap and (self._inflight + self._heap[0][1].size <= self._max_inflight or self._inflight == 0):
                    chunk = heapq.heappop(self._heap)[1]
                    chunk.queued = False
                    chunk.stream = stream
                    if not chunk.inflight:
                        chunk.inflight = True
                        self._inflight += chunk.size
                    return chunk
                remaining = end - time.monotonic()
                if remaining <= 0:
                    return None
                self._cond.wait(remaining)
            return None

    def wait(self, timeout_s: float, interrupt: Callable[[], bool]) -> None:
        """Sleep `timeout_s`, or until `interrupt()` is true after a `wake`."""
        with self._cond:
            self._cond.wait_for(lambda: self.closed or interrupt(), timeout_s)

    def wake(self) -> None:
        """Wake every `get` / `wait` to check its `interrupt`."""
        with self._cond:
            self._cond.notify_all()

    def release(self, chunks: list[Chunk]) -> None:
        """Chunks no longer in flight (acknowledged, lost with a connection, or abandoned)."""
        with self._cond:
            for chunk in chunks:
                if chunk.inflight:
                    chunk.inflight = False
                    self._inflight -= chunk.size
            self._cond.notify_all()

    def requeue_lost(self, chunks: list[Chunk], stream: int) -> None:
        """Chunks `stream` took, lost with its connection: no longer in flight, and queued again for any stream.
        One that another stream took since (a NACKed copy, put back meanwhile) is that stream's now and left
        alone: queued again too, it would go out twice, and its bytes in flight count for neither copy."""
        with self._cond:
            for chunk in chunks:
                if chunk.stream != stream:
                    continue
                chunk.stream = -1  # on no stream (its next send is a resend: `chunk.sends` counts it)
                if chunk.inflight:
                    chunk.inflight = False
                    self._inflight -= chunk.size
                if not chunk.queued and not chunk.acked and not chunk.transfer.cell.status().terminal:
                    chunk.queued = True
                    heapq.heappush(self._heap, (chunk.order, chunk))
            self._cond.notify_all()

    def backlogged(self) -> bool:
        """Chunks are waiting for a connection (the path, not the producer, is the limit)."""
        with self._cond:
            return any(not entry[1].transfer.cell.status().terminal for entry in self._heap[:8])

    @property
    def inflight_bytes(self) -> int:
        with self._cond:
            return self._inflight

    def close(self) -> None:
        with self._cond:
            self.closed = True
            self._cond.notify_all()
