"""Part buffers: where the chunks of a shipment's layer parts are put together.

`POOL` (the heap, reused by exact size) is the default; the shared-memory receiver's arena
(transport/arena.py) is another `PartPool`. Thread-safe.
"""

from __future__ import annotations

import threading
from typing import Protocol


class BufferPool:
    """Part buffers kept for reuse, by exact size (a model's KV parts come in few sizes).

    A fresh multi-megabyte buffer costs a page fault per 4 KiB page when first written; on
    loopback that was most of the receiver's CPU. Bounded by `max_bytes`; thread-safe.
    """

    def __init__(self, max_bytes: int = 256 << 20) -> None:
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._free: dict[int, list[bytearray]] = {}
        self._bytes = 0

    def get(self, size: int) -> bytearray:
        """A buffer of `size` bytes, reused (stale content) or new."""
        with self._lock:
            free = self._free.get(size)
            if free:
                self._bytes -= size
                return free.pop()
        return bytearray(size)

    def put(self, buf: bytearray | memoryview) -> None:
        with self._lock:
            if not isinstance(buf, bytearray) or not buf or self._bytes + len(buf) > self.max_bytes:
                return
            self._free.setdefault(len(buf), []).append(buf)
            self._bytes += len(buf)

    @property
    def pooled_bytes(self) -> int:
        with self._lock:
            return self._bytes


POOL = BufferPool()


class PartPool(Protocol):
    """Where part buffers come from: `POOL` (heap), or a shared-memory arena (transport/shm_receiver.py)."""

    def get(self, size: int) -> bytearray | memoryview: ...

    def put(self, buf: bytearray | memoryview) -> None: ...
