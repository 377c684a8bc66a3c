"""Receiver-side assembly of one shipment: chunks in, decoded layers out.

Shared by every receiver (TCP, in-process): it does no I/O. Chunks may arrive in any
order and more than once; a layer is exposed as soon as both its parts are complete and
decoded, so the decoding engine can start on layer 0 while later layers are in flight.
"""

from __future__ import annotations

import threading
import time
from enum import Enum
from typing import Protocol

from prfaas.transport.api import StatusCell, TransferStatus
from prfaas.transport.buffers import POOL, PartPool
from prfaas.transport.codecs import DTYPE_SIZES, CodecId, TensorMeta, get_codec
from prfaas.transport.errors import CodecError, FrameError, TicketRejected, TransferTimeout, TransportError
from prfaas.transport.open_info import OpenInfo
from prfaas.transport.tickets import Ticket

ENCODED_SLACK = 65536  # an encoded part is at most 2x its raw bytes plus this (headers, a tiny tensor's scales)


class _Part:
    """One layer part being assembled: chunk i lands at i * chunk_bytes of one buffer."""

    def __init__(self, count: int, size: int, pool: PartPool) -> None:
        self.count = count
        self.size = size
        self.buf = pool.get(size)  # every byte that is read back gets written by a chunk first
        self.claimed: dict[int, Claimant | None] = {}  # being read into the buffer now, by whom
        self.done: set[int] = set()  # verified and in place
        self.length = 0  # payload bytes once the last chunk is in


PENDING_WAIT_S = 1.0  # how long a resent chunk waits for the copy another connection is reading


class Claimant(Protocol):
    """Who reads a chunk into its slot (a receiver's connection): `abort` ends its read."""

    def abort(self) -> None: ...


class Slot(Enum):
    """Why `Inbound.slot` gave no buffer to read a chunk into."""

    DUPLICATE = "duplicate"  # already in place: acknowledge it again
    PENDING = "pending"  # another connection is still reading the same chunk
    ENDED = "ended"  # the shipment ended: drop it


LayerBuffer = bytes | bytearray | memoryview  # memoryview: a part in a shared-memory arena (shm_receiver.py)


class Inbound:
    """One expected shipment on a receiver. Thread-safe.

    tenant, max_bytes: what the reservation allows. An OPEN whose ticket names another
    tenant or grants more than `max_bytes`, or whose declared raw bytes exceed its ticket's
    budget, is refused
    and ends the shipment with that `TicketRejected` (the ticket verified: this is the job's
    own shipment, and no later OPEN can make it right). The part buffers a shipment takes
    stay within `allowance`, whatever its DATA headers claim."""

    def __init__(
        self,
        job_id: str,
        attempt: int,
        timeout_s: float,
        pool: PartPool | None = None,
        *,
        tenant: str | None = None,
        max_bytes: int | None = None,
    ) -> None:
        self.job_id = job_id
        self.pool: PartPool = pool if pool is not None else POOL
        self.attempt = attempt
        self.tenant = tenant
        self.max_bytes = max_bytes
        self.stored_bytes = 0  # part buffers taken for this shipment (bounded by `allowance`)
        self.cell = StatusCell(timeout_s)
        self.info: OpenInfo | None = None
        self.allowed = 0  # `allowance` of the accepted OPEN: the bound of `stored_bytes`
        self.ticket: Ticket | None = None
        self.wire_bytes = 0
        self.pending_wait_s = PENDING_WAIT_S
        self._lock = threading.Condition()
        self._parts: dict[tuple[int, int], _Part] = {}
        # an ended shipment's parts that a connection was still reading a chunk into: their buffers go back
        # to the pool when the last such read lets go (`commit`), never while a reader may still write
        self._draining: dict[tuple[int, int], _Part] = {}
        self._done_parts: set[tuple[int, int]] = set()  # assembled (then decoded): later copies are duplicates
        self._decoded: dict[tuple[int, int], bytes | bytearray | memoryview] = {}
        self._layers: dict[int, tuple[LayerBuffer, LayerBuffer]] = {}
        self.cell.on_terminal(self._on_terminal)

    # -- receiver side -------------------------------------------------------------------

    def open(self, info: OpenInfo, ticket: Ticket) -> bool:
        """Accept an OPEN (one per connection that carries the shipment). True on the first.
        Raises TicketRejected (and ends the shipment with it) when the ticket or the OPEN
        exceeds what the ticket or the reservation allows."""
        refusal = self._refusal(info, ticket)
        if refusal is not None:
            self.fail(refusal)
            raise refusal
        with self._lock:
            if self.cell.status().terminal:
                raise TicketRejected(f"shipment already {self.cell.status().value}")
            if self.info is not None:
                if info != self.info or ticket != self.ticket:
                    raise FrameError("OPEN disagrees with the shipment's first OPEN")
                return False
            self.info, self.ticket = info, ticket
            self.allowed = self.allowance(info, ticket)  # once: it sums over every layer
        self.cell.start()
        return True

    def _refusal(self, info: OpenInfo, ticket: Ticket) -> TicketRejected | None:
        if self.tenant is not None and ticket.tenant != self.tenant:
            return TicketRejected(f"ticket is for tenant {ticket.tenant!r}, the reservation for {self.tenant!r}")
        if self.max_bytes is not None and ticket.budget > self.max_bytes:
            return TicketRejected(f"ticket budget {ticket.budget} exceeds the reservation's budget of {self.max_bytes}")
        if info.raw_bytes > ticket.budget:
            return TicketRejected(f"shipment of {info.raw_bytes} raw bytes exceeds the ticket budget {ticket.budget}")
        if self.max_bytes is not None and info.raw_bytes > self.max_bytes:
            return TicketRejected(
                f"shipment of {info.raw_bytes} raw bytes exceeds the reservation's budget of {self.max_bytes}"
            )
        return None

    def allowance(self, info: OpenInfo, ticket: Ticket) -> int:
        """The most part-buffer bytes the shipment may take: its ticket's budget (no more than
        its reservation's), plus per part one chunk, but no more than its raw bytes + ENCODED_SLACK,
        and 4 KiB: an encoded part's buffer is whole chunks, at most 2x raw + ENCODED_SLACK, and an
        incompressible part encodes a little larger than raw. So a shipment of many tiny layers
        cannot take a whole chunk for each."""
        size = DTYPE_SIZES[info.dtype]
        per_part = (min(info.chunk_bytes, h * t * d * size + ENCODED_SLACK) + 4096 for h, t, d in info.layer_shapes)
        return ticket.budget + 2 * sum(per_part)

    def slot(
        self, layer: int, part: int, chunk: int, count: int, codec: int, raw_len: int, payload_len: int,
        claimant: Claimant | None = None,
    ) -> memoryview | Slot:  # fmt: skip
        """Where a verified chunk's payload goes: a view of the part's buffer, claimed by
        `claimant` until `commit`, so a receiver reads it from the socket straight into place.
        Raises TransportError if the chunk contradicts the OPEN (the shipment then fails).

        PENDING: another claimant is reading a copy. A sender resends a chunk only once it gave
        up on the connection it sent it on, so that copy is stale: its connection may have died
        mid-chunk without a sign (a cut link; its socket would notice only at keepalive, a
        minute on) and would hold the claim until then. It is aborted, which drops the claim."""
        info = self.info
        if info is None:
            raise FrameError("DATA before OPEN")
        if not 0 <= layer < len(info.layer_shapes) or codec != info.codec:
            raise FrameError(f"DATA for layer {layer} codec {codec} does not match the OPEN")
        heads, tokens, head_dim = info.layer_shapes[layer]
        if raw_len != heads * tokens * head_dim * DTYPE_SIZES[info.dtype]:
            raise FrameError(f"DATA raw_len {raw_len} does not match layer {layer}'s shape")
        size = info.chunk_bytes
        if codec == CodecId.RAW:  # the payload is the tensor: its chunking is fixed
            if count != max(1, -(-raw_len // size)):
                raise FrameError(f"chunk_count {count} does not fit {raw_len} raw bytes in {size}-byte chunks")
            last = raw_len - (count - 1) * size
        else:  # encoded size varies, but no codec more than doubles a tensor
            if count > max(1, -(-(2 * raw_len + ENCODED_SLACK) // size)):
                raise FrameError(f"chunk_count {count} is too large for a {raw_len}-byte tensor")
            last = payload_len if 0 < payload_len <= size else -1
        if payload_len != (last if chunk == count - 1 else size):
            raise FrameError(f"chunk {chunk} of {count} has {payload_len} payload bytes, expected chunks of {size}")
        with self._lock:
            if self.cell.status().terminal:
                return Slot.ENDED
            if (layer, part) in self._decoded or (layer, part) in self._done_parts:
                return Slot.DUPLICATE
            entry = self._parts.get((layer, part))
            if entry is None:
                nbytes = raw_len if codec == CodecId.RAW else min(count * size, 2 * raw_len + ENCODED_SLACK)
                allowed = self.allowed
                if self.stored_bytes + nbytes > allowed:
                    raise TicketRejected(
                        f"layer {layer} part {part} would take the shipment past its budget "
                        f"({self.stored_bytes + nbytes} bytes of part buffers, {allowed} allowed)"
                    )
                self.stored_bytes += nbytes
                entry = self._parts[(layer, part)] = _Part(count, nbytes, self.pool)
            if entry.count != count:
                raise FrameError(f"chunk_count {count} disagrees with {entry.count} for layer {layer} part {part}")
            if chunk in entry.done:
                return Slot.DUPLICATE
            offset = chunk * size
            if offset + payload_len > entry.size:
                raise FrameError(f"chunk {chunk} ends past the most bytes layer {layer} part {part} can encode to")
            if chunk not in entry.claimed:
                entry.claimed[chunk] = claimant
                return memoryview(entry.buf)[offset : offset + payload_len]
            stale = entry.claimed[chunk]
        if stale is not None and stale is not claimant:
            stale.abort()  # outside the lock: its reader wakes, and `commit` drops the claim
        return Slot.PENDING

    def commit(self, layer: int, part: int, chunk: int, payload_len: int, ok: bool) -> None:
        """The chunk read into `slot`'s view is verified (`ok`) or not (the claim is dropped and
        the sender resends it). Decodes the part once it is whole; exposes the layer once K
        and V are."""
        info = self.info
        assert info is not None
        if self._drained(layer, part, chunk):
            return  # the shipment ended while this chunk was read
        with self._lock:
            entry = self._parts.get((layer, part))
            if entry is None:  # the shipment ended meanwhile
                return
            entry.claimed.pop(chunk, None)
            self._lock.notify_all()  # a copy of this chunk on another connection may wait (accept)
            if not ok or self.cell.status().terminal:
                return
            entry.done.add(chunk)
            self.wire_bytes += payload_len
            if chunk == entry.count - 1:
                entry.length = chunk * info.chunk_bytes + payload_len
            if len(entry.done) < entry.count:
                return
            del self._parts[(layer, part)]
            self._done_parts.add((layer, part))
        heads, tokens, head_dim = info.layer_shapes[layer]
        raw_len = heads * tokens * head_dim * DTYPE_SIZES[info.dtype]
        decoded: bytes | bytearray | memoryview
        if info.codec == CodecId.RAW:
            decoded = entry.buf
        else:  # outside the lock: parts decode in parallel
            try:
                meta = TensorMeta(info.dtype, (heads, tokens, head_dim), part)
                decoded = get_codec(CodecId(info.codec)).decode(memoryview(entry.buf)[: entry.length], meta)
            except TransportError as exc:
                self.fail(exc)
                return
            finally:
                self.pool.put(entry.buf)  # whole, so no connection holds a claim on it
            if len(decoded) != raw_len:
                self.fail(CodecError(f"layer {layer} part {part} decoded to {len(decoded)} bytes, expected {raw_len}"))
                return
        with self._lock:
            if self.cell.status().terminal:
                return
            self._decoded[(layer, part)] = decoded
            if (layer, 1 - part) in self._decoded:
                k, v = self._decoded.pop((layer, 0)), self._decoded.pop((layer, 1))
                self._layers[layer] = (k, v)
                self._lock.notify_all()
            complete = len(self._layers) == len(info.layer_shapes)
        if complete:
            self.cell.finish(TransferStatus.COMPLETED)

    def accept(
        self,
        layer: int,
        part: int,
        chunk: int,
        count: int,
        codec: int,
        raw_len: int,
        payload: bytes | bytearray | memoryview,
        claimant: Claimant | None = None,
    ) -> Slot | None:
        """Store one verified chunk (copying it into place): None when stored, else why not.
        Raises TransportError if it contradicts the OPEN (the shipment then fails).

        A copy of a chunk that another connection is still reading (the sender resent it
        when that connection broke) waits up to `pending_wait_s` for that copy: stored ->
        DUPLICATE; dropped (its connection died mid-chunk) -> this copy is stored instead.
        Never answering it would leave the sender waiting for an ACK that no connection
        sends; PENDING is returned only if the other copy is still being read."""
        view = self.slot(layer, part, chunk, count, codec, raw_len, len(payload), claimant)
        if view is Slot.PENDING:
            end = time.monotonic() + self.pending_wait_s
            with self._lock:
                while not self.cell.status().terminal:
                    entry = self._parts.get((layer, part))
                    remaining = end - time.monotonic()
                    if entry is None or chunk not in entry.claimed or remaining <= 0:
                        break
                    self._lock.wait(remaining)
            view = self.slot(layer, part, chunk, count, codec, raw_len, len(payload), claimant)
        if isinstance(view, Slot):
            return view
        view[:] = payload
        self.commit(layer, part, chunk, len(payload), True)
        return None

    def fail(self, error: TransportError) -> None:
        self.cell.finish(TransferStatus.FAILED, error)

    def _drained(self, layer: int, part: int, chunk: int) -> bool:
        """Whether (layer, part) is a part of the ended shipment that reads still held; drops this read's claim
        and, with the last one, hands the buffer back."""
        with self._lock:
            entry = self._draining.get((layer, part))
            if entry is None:
                return False
            entry.claimed.pop(chunk, None)
            if entry.claimed:
                return True
            del self._draining[(layer, part)]
        self._free([entry.buf])
        return True

    def _free(self, buffers: list[LayerBuffer]) -> None:
        if self.pool is not POOL:  # arena memory is not garbage-collected: hand it back (see arena.Arena)
            for buf in buffers:
                if isinstance(buf, bytearray | memoryview):
                    self.pool.put(buf)

    def _on_terminal(self, status: TransferStatus) -> None:
        with self._lock:
            dropped: list[LayerBuffer] = []
            for key, entry in self._parts.items():
                if entry.claimed:  # a connection is reading a chunk into it now: freed when it lets go
                    self._draining[key] = entry
                else:
                    dropped.append(entry.buf)
            dropped += self._decoded.values()
            self._parts.clear()
            self._decoded.clear()
            if status is not TransferStatus.COMPLETED:
                dropped += [buf for pair in self._layers.values() for buf in pair]
                self._layers.clear()  # a failed shipment's KV must not be used, nor kept
            self._lock.notify_all()
        self._free(dropped)

    # -- consumer side -------------------------------------------------------------------

    def status(self) -> TransferStatus:
        return self.cell.status()

    @property
    def error(self) -> TransportError | None:
        return self.cell.error

    def wait(self, timeout_s: float | None = None) -> TransferStatus:
        return self.cell.wait(timeout_s)

    def layer(self, index: int, timeout_s: float) -> tuple[LayerBuffer, LayerBuffer]:
        """Layer `index`'s decoded (K, V) bytes, waiting for them at most `timeout_s`.
        Raises the shipment's error if it ended without them, TransferTimeout on timeout."""
        with self._lock:
            self._lock.wait_for(lambda: index in self._layers or self.cell.status().terminal, timeout_s)
            if index in self._layers:
                return self._layers[index]
        self.cell.expire_if_due()
        error = self.cell.error
        raise error if error is not None else TransferTimeout(f"layer {index} did not arrive within {timeout_s} s")

    def cancel(self, reason: str = "canceled by the receiver") -> None:
        self.cell.cancel(reason)

    def release(self) -> None:
        """Drop the received KV once the engine has copied it: the buffers `layer` returned
        are reused for later shipments, so nothing may read them after this."""
        with self._lock:
            layers = list(self._layers.values())
            self._layers.clear()
        for k, v in layers:
            for buf in (k, v):
                if isinstance(buf, bytearray | memoryview):
                    self.pool.put(buf)


class Receiver(Protocol):
    """What a decode region needs of any receiver (TCP, shared memory, WebRTC, in-process)."""

    def expect(
        self, job_id: str, attempt: int, timeout_s: float, *, tenant: str | None = None, max_bytes: int | None = None
    ) -> Inbound:
        """Register a shipment the decode region holds room for: KV for anything else is
        refused. With `tenant` / `max_bytes`, an OPEN whose ticket names another tenant, or
        whose ticket budget or raw bytes exceed `max_bytes`, is refused before any KV is
        stored (the sender's transfer fails with `TicketRejected`; the inbound ends with it)."""
        ...
