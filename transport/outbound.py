"""The sending half of the wire protocol for one transfer, independent of how frames travel.

An `OutboundTransfer` turns layers into encoded, checksummed DATA frames (once; resends
reuse the bytes), tracks which chunks the receiver acknowledged, and settles the
transfer's status from the receiver's DONE / ERROR / CANCEL. Channels own the sockets
and call `ack`, `nack`, `done`, `remote_error`, `remote_cancel` as frames arrive.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field

from prfaas.transport.api import Buffer, Shipment, ShipmentSpec, StatusCell, TransferStats, TransferStatus
from prfaas.transport.codecs import CodecId, TensorMeta, checked_view, get_codec
from prfaas.transport.errors import (
    PeerUnavailable,
    TicketRejected,
    TransferCanceled,
    TransferTimeout,
    TransportError,
)
from prfaas.transport.framing import (
    ChunkKey,
    ErrorCode,
    Frame,
    FrameType,
    encode,
    encode_header,
    job_bytes,
    json_payload,
    parse_ack,
)
from prfaas.transport.open_info import OpenInfo

log = logging.getLogger(__name__)
_seq = itertools.count()


def encoder_pool(threads: int, prefix: str) -> ThreadPoolExecutor:
    """A channel's encode threads. They run on the CPUs of the thread that made the channel,
    not of whichever thread first hands them a layer: a forward pinned to its own cores
    (engine/hf.py `pinned`) starts them from inside the forward and would keep them there."""
    cpus = os.sched_getaffinity(0)
    return ThreadPoolExecutor(threads, prefix, initializer=os.sched_setaffinity, initargs=(0, cpus))


@dataclass(eq=False)
class Chunk:
    transfer: OutboundTransfer
    key: ChunkKey
    header: bytes  # the DATA frame's 64-byte header
    payload: bytes | memoryview  # its payload: a view into the encoded part (raw: the producer's buffer)
    raw_share: int  # raw KV bytes this chunk stands for (stats)
    seq: int = field(default_factory=lambda: next(_seq))
    stream: int | None = None  # stream that last took it from the queue (-1: that stream broke)
    sends: int = 0  # sends that completed (the socket took every byte)
    queued: bool = False  # waiting in a channel's send queue (never twice)
    inflight: bool = False  # counted against the channel's in-flight byte budget
    acked: bool = False  # the receiver has it: a copy still queued (after a NACK) is not sent again

    @property
    def size(self) -> int:
        """Bytes on the wire."""
        return len(self.header) + len(self.payload)

    def frame_bytes(self) -> bytes:
        return self.header + bytes(self.payload)

    @property
    def order(self) -> tuple[float, int]:
        """Earliest deadline first; within a transfer, layer order."""
        return (self.transfer.cell.deadline, self.seq)


class OutboundTransfer:
    """One shipment in flight on a channel. Implements `Transfer`."""

    def __init__(
        self,
        shipment: Shipment,
        enqueue: Callable[[list[Chunk]], None],
        executor: Executor | None = None,
        *,
        checksum_payload: bool = True,
    ) -> None:
        spec: ShipmentSpec = shipment.spec
        self.checksum_payload = checksum_payload  # False only where no payload crosses a wire in the clear (shm, TLS)
        self.spec = spec
        self.job = job_bytes(spec.job_id)
        self.stats = TransferStats()
        self.cell = StatusCell(spec.timeout_s)
        self._codec = get_codec(spec.codec)
        self._enqueue = enqueue
        self._executor = executor
        self._lock = threading.Lock()
        self._unacked: dict[ChunkKey, Chunk] = {}
        self._parts_encoded = 0
        self._layers_given = 0  # handed in by the producer (each is two parts to encode)
        info = OpenInfo(spec.dtype, spec.layer_shapes, int(self._codec.codec_id), spec.chunk_bytes, spec.traceparent)
        self.open_frame = encode(
            Frame(FrameType.OPEN, self.job, spec.attempt, payload=json_payload(info.to_json(spec.ticket)))
        )
        self.remote_ended = False  # the receiver ended it: no CANCEL needs to go back
        self.accepted = False  # the receiver answered an OPEN of this transfer with OPEN_OK
        self._shipment = shipment

    def start(self) -> None:
        """Begin encoding layers (the channel calls this after its OPEN is on the way)."""
        self.cell.start()
        self._shipment.bind(self._on_layer)

    @property
    def key(self) -> tuple[bytes, int]:
        return (self.job, self.spec.attempt)

    # -- Transfer ------------------------------------------------------------------------

    def status(self) -> TransferStatus:
        return self.cell.status()

    def wait(self, timeout_s: float | None = None) -> TransferStatus:
        return self.cell.wait(timeout_s)

    def cancel(self) -> None:
        self.cell.cancel("canceled by the sender")

    @property
    def error(self) -> TransportError | None:
        return self.cell.error

    # -- producer side -------------------------------------------------------------------

    @property
    def encoding_backlog(self) -> int:
        """Layer parts handed in and not yet encoded (while live): the sender's CPU, not the producer,
        is what holds them."""
        if self.cell.status().terminal:
            return 0
        with self._lock:
            return 2 * self._layers_given - self._parts_encoded

    def _on_layer(self, index: int, k: Buffer, v: Buffer) -> None:
        with self._lock:
            self._layers_given += 1
        if self._executor is None:
            self._encode_layer(index, k, v)
            return
        try:
            self._executor.submit(self._encode_layer, index, k, v)
        except RuntimeError:  # the channel closed its encoders: it canceled this transfer first
            if not self.cell.status().terminal:
                raise

    def _encode_layer(self, index: int, k: Buffer, v: Buffer) -> None:
        if self.cell.status().terminal:
            return
        chunks: list[Chunk] = []
        try:
            for part, data in enumerate((k, v)):
                weights = self.spec.layer_key_weights(index) if part == 0 else None
                meta = TensorMeta(self.spec.dtype, self.spec.layer_shapes[index], part, weights)
                if self._codec.codec_id is CodecId.RAW:  # no copy: chunks are views of the producer's buffer
                    payload = checked_view(self._codec.name, data, meta)
                else:
                    payload = memoryview(self._codec.encode(memoryview(data), meta))
                size = self.spec.chunk_bytes
                count = max(1, -(-len(payload) // size))
                raw_len = self.spec.part_bytes(index)
                for i in range(count):
                    body = payload[i * size : (i + 1) * size]
                    frame = Frame(FrameType.DATA, self.job, self.spec.attempt, index, part, int(self._codec.codec_id),
                                  i, count, raw_len, body)  # fmt: skip
                    share = raw_len // count + (raw_len % count if i == count - 1 else 0)
                    header = encode_header(frame, checksum_payload=self.checksum_payload)
                    chunks.append(Chunk(self, (index, part, i), header, body, share))
        except TransportError as exc:
            self.cell.finish(TransferStatus.FAILED, exc)
            return
        except Exception as exc:  # a codec's or the header's own error: the transfer fails now, not at its deadline
            log.exception("job %s layer %d: encoding failed", self.spec.job_id, index)
            self.cell.finish(TransferStatus.FAILED, TransportError(f"encoding layer {index} failed: {exc!r}"))
            return
        with self._lock:
            for chunk in chunks:
                self._unacked[chunk.key] = chunk
            self._parts_encoded += 2
        self._enqueue(chunks)

    # -- frames from the receiver ----------------------------------------------------------

    def sent(self, chunk: Chunk) -> None:
        """A send of `chunk` completed (every one after its first is a resend)."""
        with self._lock:
            self.stats.wire_bytes += chunk.size
            if chunk.sends:
                self.stats.resent_chunks += 1
                self.stats.resent_bytes += chunk.size
            chunk.sends += 1

    def ack(self, keys: list[ChunkKey]) -> list[Chunk]:
        """Mark chunks acknowledged; returns those that were outstanding."""
        acked = []
        with self._lock:
            for key in keys:
                chunk = self._unacked.pop(key, None)
                if chunk is not None:
                    chunk.acked = True
                    self.stats.raw_bytes += chunk.raw_share
                    acked.append(chunk)
        return acked

    def nack(self, key: ChunkKey) -> Chunk | None:
        with self._lock:
            return self._unacked.get(key)

    def unacked_on(self, stream: int) -> list[Chunk]:
        with self._lock:
            return [c for c in self._unacked.values() if c.stream == stream]

    @property
    def unacked(self) -> int:
        """Chunks sent or queued and not acknowledged yet."""
        with self._lock:
            return len(self._unacked)

    def drop_unacked(self) -> list[Chunk]:
        """Forget every outstanding chunk (the transfer ended); returns them."""
        with self._lock:
            chunks = list(self._unacked.values())
            self._unacked.clear()
        return chunks

    def done(self) -> None:
        self.stats.finished_s = time.monotonic()
        self.stats.raw_bytes = self.spec.raw_bytes  # DONE: all of it arrived (last ACKs may trail)
        self.cell.finish(TransferStatus.COMPLETED)

    def remote_error(self, code: str, message: str) -> None:
        self.remote_ended = True
        error: TransportError
        if code in (ErrorCode.TICKET_REJECTED, ErrorCode.OVER_BUDGET):
            error = TicketRejected(f"receiver refused the ticket: {message}")
        elif code == ErrorCode.DEADLINE:
            error = TransferTimeout(f"receiver: {message}")
        elif code == ErrorCode.UNKNOWN_SHIPMENT:
            error = PeerUnavailable(f"receiver has no reservation for this shipment: {message}")
        else:
            error = TransportError(f"receiver error {code}: {message}")
        status = TransferStatus.TIMEOUT if isinstance(error, TransferTimeout) else TransferStatus.FAILED
        self.stats.finished_s = time.monotonic()
        self.cell.finish(status, error)

    def remote_cancel(self, reason: str) -> None:
        self.remote_ended = True
        self.cell.finish(TransferStatus.CANCELED, TransferCanceled(f"receiver canceled: {reason}"))


class TransferTable:
    """A channel's live transfers, and what each reply frame from the receiver means."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._transfers: dict[tuple[bytes, int], OutboundTransfer] = {}

    def add(self, transfer: OutboundTransfer) -> None:
        with self._lock:
            if transfer.key in self._transfers:
                raise ValueError(f"job {transfer.spec.job_id} attempt {transfer.spec.attempt} is already in flight")
            self._transfers[transfer.key] = transfer
        transfer.cell.on_terminal(lambda _status: self._remove(transfer))

    def _remove(self, transfer: OutboundTransfer) -> None:
        with self._lock:
            if self._transfers.get(transfer.key) is transfer:
                del self._transfers[transfer.key]

    def live(self) -> list[OutboundTransfer]:
        with self._lock:
            return list(self._transfers.values())

    def get(self, key: tuple[bytes, int]) -> OutboundTransfer | None:
        with self._lock:
            return self._transfers.get(key)

    def on_reply(self, frame: Frame) -> tuple[list[Chunk], list[Chunk]]:
        """Apply one receiver frame: (chunks now acknowledged, chunks to send again)."""
        transfer = self.get((frame.job_id, frame.attempt))
        if transfer is None:
            return [], []  # a transfer that already ended; stale replies are ignored
        if frame.type is FrameType.ACK:
            return transfer.ack(parse_ack(frame.payload)), []
        if frame.type is FrameType.NACK:
            chunk = transfer.nack(frame.key)
            return [], [chunk] if chunk is not None else []
        if frame.type is FrameType.OPEN_OK:
            transfer.accepted = True
        elif frame.type is FrameType.DONE:
            # Only after an OPEN_OK: on one connection OPEN_OK always precedes DONE, so a
            # DONE left over from an earlier shipment of the same job attempt is ignored.
            if transfer.accepted:
                transfer.done()
        elif frame.type is FrameType.ERROR:
            body = frame.json()
            code, message = (body.get("code", "?"), body.get("message", "")) if isinstance(body, dict) else ("?", "")
            transfer.remote_error(str(code), str(message))
        elif frame.type is FrameType.CANCEL:
            transfer.remote_cancel(bytes(frame.payload).decode(errors="replace"))
        return [], []
