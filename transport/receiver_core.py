"""The receiving half of the wire protocol, independent of how frames travel.

`ReceiverCore.handle(frame, ok, session)` applies docs/wire-format.md's receiver rules
and returns the frames to send back on that session. Every receiver (TCP, shared memory,
WebRTC, in-process) drives it, so all enforce the same tickets, budgets and checksums.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from prfaas.transport.api import TransferStatus
from prfaas.transport.buffers import PartPool
from prfaas.transport.errors import (
    FrameError,
    TicketRejected,
    TransferCanceled,
    TransferTimeout,
    TransportError,
)
from prfaas.transport.framing import SUPPORTED_VERSIONS, ErrorCode, Frame, FrameType, Header, error_frame, json_payload
from prfaas.transport.framing import ack_payload as _ack_payload
from prfaas.transport.inbound import Inbound, Slot
from prfaas.transport.open_info import OpenInfo
from prfaas.transport.tickets import ReplayGuard, TicketVerifier

log = logging.getLogger(__name__)
Key = tuple[bytes, int]  # (job_id bytes, attempt)
_NOT_OPEN = "DATA for a shipment that is not open on this connection"
RECENT_SHIPMENTS = 4096  # ended shipments remembered, so late frames of a delivered one get DONE / ACK


class Session:
    """One connection's state on the receiver. `send` delivers frames back to the sender.

    verified: the peer has proven it is a prefill region (transport/admission.py): its TLS
    certificate's identity was checked (`authenticated`, set by the connection) and it said
    HELLO, or an OPEN on it carried a ticket that verifies (`ticketed`)."""

    def __init__(self, send: Callable[[Frame], None], abort: Callable[[], None] | None = None) -> None:
        self.send = send
        self._abort = abort  # ends the connection (a `Claimant` whose read of a chunk went stale)
        self.hello = False
        self.version = 0
        self.authenticated = False
        self.ticketed = False
        self.peer = ""  # who counts against `max_per_peer` once verified ("": no one), set by the connection
        self.opened: dict[Key, int] = {}  # shipments whose OPEN was accepted here -> their chunk_bytes
        self.reading: Inbound | None = None  # the shipment whose chunk this connection reads into place now
        self.chunk_bytes = 0  # the largest chunk_bytes accepted here: the bound of its DATA frames

    @property
    def verified(self) -> bool:
        return self.hello and (self.authenticated or self.ticketed)

    def abort(self) -> None:
        if self._abort is not None:
            self._abort()


@dataclass(frozen=True)
class Discard:
    """A DATA frame whose payload is not wanted (unknown, ended, duplicate, or refused): read
    it past, then send `replies`."""

    replies: list[Frame]


class ReceiverCore:
    """Expected shipments and the protocol rules for the frames that fill them."""

    def __init__(self, verifier: TicketVerifier, node: str = "receiver", pool: PartPool | None = None) -> None:
        self.node = node
        self.pool = pool  # where part buffers come from (None: the heap pool)
        self._verifier = verifier
        self._replay = ReplayGuard()
        self._lock = threading.Lock()
        self._inbounds: dict[Key, Inbound] = {}
        self._sessions: dict[Key, set[Session]] = {}
        # ended shipments, newest last: how each ended, and the frame that told its sender
        self._recent: OrderedDict[Key, tuple[TransferStatus, Frame | None]] = OrderedDict()

    def expect(
        self, job_id: str, attempt: int, timeout_s: float, *, tenant: str | None = None, max_bytes: int | None = None
    ) -> Inbound:
        """Register a shipment this receiver holds room for; KV for anything else is refused.
        `tenant`, `max_bytes`: what the reservation allows (`Inbound.open` checks the OPEN)."""
        key = (uuid.UUID(job_id).bytes, attempt)
        inbound = Inbound(job_id, attempt, timeout_s, self.pool, tenant=tenant, max_bytes=max_bytes)
        with self._lock:
            if key in self._inbounds:
                raise ValueError(f"job {job_id} attempt {attempt} is already expected")
            self._inbounds[key] = inbound
            self._sessions[key] = set()
        inbound.cell.on_terminal(lambda status: self._ended(key, inbound, status))
        return inbound

    def expire_due(self) -> None:
        """End shipments past their deadline (called periodically by the server)."""
        with self._lock:
            inbounds = list(self._inbounds.values())
        now = time.monotonic()
        for inbound in inbounds:
            inbound.cell.expire_if_due(now)

    def cancel_all(self, reason: str) -> None:
        """End every expected shipment (the receiver is shutting down): frees their buffers."""
        with self._lock:
            inbounds = list(self._inbounds.values())
        for inbound in inbounds:
            inbound.cancel(reason)

    @property
    def num_expected(self) -> int:
        with self._lock:
            return len(self._inbounds)

    def _ended(self, key: Key, inbound: Inbound, status: TransferStatus) -> None:
        reply = _end_frame(key, status, inbound.error)
        with self._lock:
            self._inbounds.pop(key, None)
            self._recent[key] = (status, reply)
            while len(self._recent) > RECENT_SHIPMENTS:
                self._recent.popitem(last=False)
            sessions = self._sessions.pop(key, set())
        for session in sessions:
            session.opened.pop(key, None)
        if inbound.ticket is not None:
            self._replay.retire(inbound.ticket)
        if reply is not None:
            for session in sessions:  # every connection that carried it: one may be broken
                session.send(reply)

    def handle(self, frame: Frame, payload_ok: bool, session: Session) -> list[Frame]:
        """Apply one frame from `session`; return the replies. Raises FrameError when the
        connection must be closed (it has lost framing, broken the handshake, or sent a frame
        other than DATA whose payload fails its checksum)."""
        if frame.type is not FrameType.DATA and not payload_ok:
            # a corrupted OPEN or CANCEL would be acted on (a flipped digit in a shape refuses the shipment for
            # good): close the connection instead, its sender reconnects and sends the frame again. (A DATA
            # frame's bad payload is NACKed, that chunk alone sent again.)
            raise FrameError("payload checksum mismatch")
        if not session.hello:
            return self._hello(frame, session)
        key = (frame.job_id, frame.attempt)
        if frame.type is FrameType.OPEN:
            return self._open(frame, key, session)
        if frame.type is FrameType.DATA:
            return self._data(frame, payload_ok, key, session)
        if frame.type is FrameType.CANCEL:  # only a connection that opened the shipment may cancel it
            with self._lock:
                inbound = self._inbounds.get(key) if key in session.opened else None
            if inbound is not None:
                inbound.cell.cancel(f"canceled by the sender: {bytes(frame.payload).decode(errors='replace')}")
            return []
        if frame.type is FrameType.PING:
            return [Frame(FrameType.PONG, payload=frame.payload)]
        if frame.type is FrameType.ERROR:
            log.warning("sender reported an error: %s", bytes(frame.payload)[:200])
            return []
        raise FrameError(f"a receiver does not accept {frame.type.name} frames")

    def _hello(self, frame: Frame, session: Session) -> list[Frame]:
        if frame.type is not FrameType.HELLO:
            raise FrameError(f"first frame must be HELLO, got {frame.type.name}")
        hello = frame.json()
        versions = hello.get("versions") if isinstance(hello, dict) else None
        offered = versions if isinstance(versions, list) else []
        common = {v for v in offered if isinstance(v, int) and not isinstance(v, bool)} & set(SUPPORTED_VERSIONS)
        if not common:
            session.send(
                error_frame(ErrorCode.UNSUPPORTED_VERSION, f"receiver speaks versions {list(SUPPORTED_VERSIONS)}")
            )
            raise FrameError(f"no common wire version: sender offers {versions}")
        session.hello, session.version = True, max(common)
        return [Frame(FrameType.HELLO_OK, payload=json_payload({"version": session.version, "node": self.node}))]

    def _open(self, frame: Frame, key: Key, session: Session) -> list[Frame]:
        job, attempt = key
        with self._lock:
            inbound = self._inbounds.get(key)
        try:
            info, token = OpenInfo.from_json(frame.json())
            ticket = self._verifier.verify(token, job=str(uuid.UUID(bytes=job)), attempt=attempt)
            # a signed ticket proves the peer only when it opens a shipment this receiver expects (or one that
            # it delivered): a used or stray one may have been read off a plaintext wire
            if self._completed(key, inbound):
                session.ticketed = True
                # A stream that opened late, after the other streams finished the shipment: it is
                # done, say so on this connection too (the sender may read this before the DONE
                # that went to the others; an error here would fail a delivered shipment).
                return [Frame(FrameType.OPEN_OK, job, attempt), Frame(FrameType.DONE, job, attempt)]
            ended = self._end_of(key, inbound)
            if ended is not None:
                # A stream that opened late, after the shipment ended otherwise (canceled, refused,
                # past its deadline): tell it how, as the streams that carried it were told.
                return [ended]
            if inbound is None:
                return [error_frame(ErrorCode.UNKNOWN_SHIPMENT, "no reservation for this job attempt", job, attempt)]
            self._replay.check(ticket)
            inbound.open(info, ticket)  # a ticket for another tenant or over the reservation ends it
            session.ticketed = True  # a ticket the control plane signed, for this very shipment: a prefill region
        except TicketRejected as exc:
            ended = self._end_of(key, inbound) if inbound is not None else None  # it ended meanwhile: how
            return [ended or error_frame(_ticket_code(exc), str(exc), job, attempt)]
        except FrameError as exc:
            return [error_frame(ErrorCode.BAD_FRAME, str(exc), job, attempt)]
        with self._lock:
            if key in self._sessions:
                self._sessions[key].add(session)
                session.opened[key] = info.chunk_bytes
                session.chunk_bytes = max(session.chunk_bytes, info.chunk_bytes)
        return [Frame(FrameType.OPEN_OK, job, attempt)]

    def _completed(self, key: Key, inbound: Inbound | None) -> bool:
        """The shipment `key` was delivered whole (and may have been forgotten already)."""
        if inbound is not None:
            return inbound.status() is TransferStatus.COMPLETED
        with self._lock:
            recent = self._recent.get(key)
        return recent is not None and recent[0] is TransferStatus.COMPLETED

    def _end_of(self, key: Key, inbound: Inbound | None) -> Frame | None:
        """The frame that ended shipment `key` other than delivered, if it has ended so."""
        if inbound is not None:
            status = inbound.status()
            return _end_frame(key, status, inbound.error) if status.terminal else None
        with self._lock:
            recent = self._recent.get(key)
        return recent[1] if recent is not None else None

    def _data(self, frame: Frame, payload_ok: bool, key: Key, session: Session) -> list[Frame]:
        job, attempt = key
        with self._lock:
            inbound = self._inbounds.get(key)
        if inbound is None and self._completed(key, None):
            return [Frame(FrameType.ACK, job, attempt, payload=_ack_payload([frame.key]))]  # a late duplicate
        ended = self._end_of(key, None) if inbound is None else None
        if ended is not None:  # a chunk in flight when the shipment ended otherwise: tell how, as its OPEN would
            return [ended]
        if inbound is None or inbound.info is None or key not in session.opened:
            return [error_frame(ErrorCode.UNKNOWN_SHIPMENT, _NOT_OPEN, job, attempt)]
        if not payload_ok:
            return [Frame(FrameType.NACK, job, attempt, frame.layer, frame.part, chunk=frame.chunk)]
        try:
            result = inbound.accept(
                frame.layer, frame.part, frame.chunk, frame.chunk_count, frame.codec, frame.raw_len, frame.payload,
                session,
            )  # fmt: skip
        except TransportError as exc:
            inbound.fail(exc)
            return []  # _ended tells the sender
        if result is Slot.PENDING:  # another connection is still reading its copy: send this one again later
            return [Frame(FrameType.NACK, job, attempt, frame.layer, frame.part, chunk=frame.chunk)]
        return [Frame(FrameType.ACK, job, attempt, payload=_ack_payload([frame.key]))]

    def data_slot(self, header: Header, session: Session) -> memoryview | Discard | None:
        """For a DATA frame whose header was read: the buffer its payload belongs in, claimed
        (read the payload into it, then call `data_commit`); or `Discard` when the payload
        is not wanted (read it past, send the replies); or None, for a chunk another connection
        is still reading: read the payload into memory of its own (bounded by this shipment's
        chunk size, which a verified ticket allowed) and pass the whole frame to `handle`."""
        if not session.hello:
            raise FrameError("first frame must be HELLO, got DATA")
        key = (header.job_id, header.attempt)
        job, attempt = key
        chunk = (header.layer, header.part, header.chunk)
        with self._lock:
            inbound = self._inbounds.get(key)
        if inbound is None and self._completed(key, None):
            return Discard([Frame(FrameType.ACK, job, attempt, payload=_ack_payload([chunk]))])  # a late duplicate
        ended = self._end_of(key, None) if inbound is None else None
        if ended is not None:  # a chunk in flight when the shipment ended otherwise (canceled, refused, late):
            return Discard([ended])  # tell its stream how, not UNKNOWN_SHIPMENT (which would fail the sender)
        if inbound is None or inbound.info is None or key not in session.opened:
            return Discard([error_frame(ErrorCode.UNKNOWN_SHIPMENT, _NOT_OPEN, job, attempt)])
        try:
            view = inbound.slot(
                header.layer, header.part, header.chunk, header.chunk_count, header.codec, header.raw_len,
                header.payload_len, session,
            )  # fmt: skip
        except TransportError as exc:
            inbound.fail(exc)
            return Discard([])  # _ended tells the sender
        if view is Slot.PENDING:
            return None
        if isinstance(view, Slot):  # a duplicate, or the shipment ended: acknowledge it again
            return Discard([Frame(FrameType.ACK, job, attempt, payload=_ack_payload([chunk]))])
        session.reading = inbound
        return view

    def data_commit(self, header: Header, payload_ok: bool, session: Session) -> list[Frame]:
        """The payload of a `data_slot` frame is in place: ACK it, or NACK a bad checksum. The claim goes
        back to the shipment the slot came from, even one that ended meanwhile (its buffer is freed then)."""
        job, attempt = header.job_id, header.attempt
        inbound, session.reading = session.reading, None
        if inbound is not None:
            inbound.commit(header.layer, header.part, header.chunk, header.payload_len, payload_ok)
        if not payload_ok:
            return [Frame(FrameType.NACK, job, attempt, header.layer, header.part, chunk=header.chunk)]
        return [Frame(FrameType.ACK, job, attempt, payload=_ack_payload([(header.layer, header.part, header.chunk)]))]


def _ticket_code(error: TicketRejected) -> str:
    return ErrorCode.OVER_BUDGET if "budget" in str(error) else ErrorCode.TICKET_REJECTED


def _end_frame(key: Key, status: TransferStatus, error: TransportError | None) -> Frame | None:
    """What tells a sender how its shipment ended: DONE, CANCEL, or ERROR with its code."""
    job, attempt = key
    if status is TransferStatus.COMPLETED:
        return Frame(FrameType.DONE, job, attempt)
    if isinstance(error, TransferCanceled):
        return Frame(FrameType.CANCEL, job, attempt, payload=str(error).encode())
    if isinstance(error, TransferTimeout):
        return error_frame(ErrorCode.DEADLINE, str(error), job, attempt)
    if isinstance(error, TicketRejected):
        return error_frame(_ticket_code(error), str(error), job, attempt)
    if error is not None:
        return error_frame(ErrorCode.INTERNAL, str(error), job, attempt)
    return None
