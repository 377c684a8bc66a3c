"""Where the TLS records of a received byte stream end (transport/tls.py's reader waits for the
rest of a record it has part of, on a WAN path)."""

from __future__ import annotations

import struct


class RecordFraming:
    """Where the TLS records of a received byte stream end, so that a reader whose data came
    in part of a record waits once for the rest (`MSG_WAITALL`) instead of waking per packet:
    over a WAN, packets of a 16 KiB record arrive a few at a time, and each wake-up that finds
    no whole record costs a receive and a failed decrypt. Records are checked as they are
    framed (TLS 1.3 content types, legacy version, length); anything unexpected turns the
    waiting off for good (`missing` 0), so a misreading can never make a reader wait for bytes
    that are not coming. Off from the start on a path under LAN_RTT_S (loopback, one region):
    receives there are large, and framing them costs ~0.02 CPU s/GB for nothing."""

    MAX_RECORD = (16 << 10) + 256  # ciphertext of one TLS 1.3 record, at most

    def __init__(self) -> None:
        self._header = bytearray()
        self._left = 0  # body bytes of the current record not yet received
        self.valid = True

    def advance(self, data: memoryview) -> int:
        """Frame `data`, the next bytes of the stream; -> bytes still missing to end the record
        it stops in (0: it ends on a boundary, or framing is off). One C call per record."""
        i, n = 0, len(data)
        while self.valid and i < n:
            if self._left:
                take = min(self._left, n - i)
                self._left -= take
                i += take
            elif self._header or n - i < 5:  # a header split across receives
                take = min(5 - len(self._header), n - i)
                self._header += data[i : i + take]
                i += take
                if len(self._header) == 5:
                    self._start(*_HEADER.unpack_from(self._header))
                    self._header.clear()
            else:
                self._start(*_HEADER.unpack_from(data, i))
                i += 5
        if not self.valid:
            return 0
        return self._left + (5 - len(self._header) if self._header else 0)

    def _start(self, kind: int, version: int, length: int) -> None:
        if kind not in (20, 21, 22, 23) or version != 0x0303 or not 0 < length <= self.MAX_RECORD:
            self.valid = False
        self._left = length


_HEADER = struct.Struct("!BHH")  # a TLS record's content type, legacy version, length
