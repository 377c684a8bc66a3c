"""A shared-memory arena: one memfd, mapped by the receiver and by every same-host sender,
carved into part buffers (first fit, page aligned). Implements `inbound.PartPool`.

A full arena hands out heap buffers instead (the shipment then travels inline). Freed
ranges wait `quarantine_s` before reuse: a sender that is still copying a chunk of a
shipment that was just canceled must not land in the next shipment's KV.
"""

from __future__ import annotations

import bisect
import contextlib
import mmap
import os
import threading
import time
from collections import deque

import numpy as np

PAGE = 4096
POPULATE = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
QUARANTINE_S = 1.0


def address_of(buf: bytes | bytearray | memoryview | mmap.mmap) -> int:
    """The address of a buffer's first byte (numpy reads it from the buffer protocol)."""
    return int(np.frombuffer(buf, dtype=np.uint8).ctypes.data)


class Arena:
    def __init__(self, size_bytes: int, quarantine_s: float = QUARANTINE_S) -> None:
        if size_bytes < PAGE:
            raise ValueError(f"arena_bytes must be at least {PAGE}, got {size_bytes}")
        self.size = size_bytes
        self.quarantine_s = quarantine_s
        self.fd = os.memfd_create("prfaas-kv-arena", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, size_bytes)
        # MAP_POPULATE: fault every page in now. A fresh shared page costs a fault and a zeroing
        # on first write; measured here, a cold arena took chunks at 0.15 GB/s, a warm one at 5-8.
        self.map = mmap.mmap(self.fd, size_bytes, flags=POPULATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self.buf = memoryview(self.map)
        self.base = address_of(self.map)
        self._lock = threading.Lock()
        self._free: list[tuple[int, int]] = [(0, size_bytes)]  # (offset, size), sorted, never adjacent
        self._used: dict[int, int] = {}  # offset -> size
        self._cooling: deque[tuple[float, int, int]] = deque()  # (reusable at, offset, size)

    def get(self, size: int) -> bytearray | memoryview:
        """A buffer of `size` bytes in the arena, or on the heap when the arena is full."""
        need = max(PAGE, -(-size // PAGE) * PAGE)
        with self._lock:
            self._thaw(time.monotonic())
            for index, (offset, free) in enumerate(self._free):
                if free >= need:
                    if free == need:
                        del self._free[index]
                    else:
                        self._free[index] = (offset + need, free - need)
                    self._used[offset] = need
                    return self.buf[offset : offset + size]
        return bytearray(size)

    def put(self, buf: bytearray | memoryview) -> None:
        """Give back a buffer `get` returned (others, and a second put, are ignored)."""
        offset = self.offset_of(buf)
        if offset is None:
            return
        with self._lock:
            size = self._used.pop(offset, None)
            if size is not None:
                self._cooling.append((time.monotonic() + self.quarantine_s, offset, size))

    def _thaw(self, now: float) -> None:
        while self._cooling and self._cooling[0][0] <= now:
            _, offset, size = self._cooling.popleft()
            index = bisect.bisect(self._free, (offset, size))
            if index < len(self._free) and self._free[index][0] == offset + size:  # merge with the next
                size += self._free.pop(index)[1]
            if index > 0 and sum(self._free[index - 1]) == offset:  # and with the previous
                offset, size = self._free[index - 1][0], self._free[index - 1][1] + size
                del self._free[index - 1]
                index -= 1
            self._free.insert(index, (offset, size))

    def offset_of(self, buf: object) -> int | None:
        """Where `buf` starts in the arena, or None if it is not arena memory."""
        if not isinstance(buf, memoryview):
            return None
        address = address_of(buf)
        return address - self.base if self.base <= address < self.base + self.size else None

    def view(self, offset: int, length: int) -> memoryview:
        if not 0 <= offset <= offset + length <= self.size:
            raise ValueError(f"[{offset}, {offset + length}) is outside the {self.size}-byte arena")
        return self.buf[offset : offset + length]

    @property
    def used_bytes(self) -> int:
        """Bytes held by live buffers and by the quarantine."""
        with self._lock:
            self._thaw(time.monotonic())
            return sum(self._used.values()) + sum(size for _, _, size in self._cooling)

    def close(self) -> None:
        """Unmap and close the memfd; a mapping still viewed by a consumer lives until it lets go."""
        with contextlib.suppress(BufferError):
            self.buf.release()
            self.map.close()
        with contextlib.suppress(OSError):
            os.close(self.fd)
