"""The in-process transport: the TCP protocol's frames passed by function call.

Same API, same frames, tickets, checksums and receiver rules as TCP (both drive
`ReceiverCore` and `OutboundTransfer`); only sockets are missing. Used by unit tests and
as the same-process path. Delivery is synchronous: `add_layer` returns once the layer was
received and acknowledged.
"""

from __future__ import annotations

import threading

from prfaas.transport.api import Shipment, TransferStatus
from prfaas.transport.framing import Frame, FrameType, encode, json_payload, parse
from prfaas.transport.inbound import Inbound
from prfaas.transport.outbound import Chunk, OutboundTransfer, TransferTable
from prfaas.transport.receiver_core import ReceiverCore, Session
from prfaas.transport.tickets import TicketVerifier


class InProcessReceiver:
    def __init__(self, verifier: TicketVerifier, node: str = "inproc-receiver") -> None:
        self.core = ReceiverCore(verifier, node)

    def expect(
        self, job_id: str, attempt: int, timeout_s: float, *, tenant: str | None = None, max_bytes: int | None = None
    ) -> Inbound:
        return self.core.expect(job_id, attempt, timeout_s, tenant=tenant, max_bytes=max_bytes)


class InProcessChannel:
    """A channel to an `InProcessReceiver`. Implements `Channel`."""

    def __init__(self, receiver: InProcessReceiver, node: str = "inproc-sender") -> None:
        self._core = receiver.core
        self._table = TransferTable()
        self._lock = threading.RLock()  # one "connection": frames are handled one at a time
        self._session = Session(self._on_reply)
        self._closed = False
        self._send(encode(Frame(FrameType.HELLO, payload=json_payload({"versions": [1], "node": node}))))

    def _send(self, data: bytes) -> None:
        frame, ok = parse(data)
        with self._lock:
            replies = self._core.handle(frame, ok, self._session)
        for reply in replies:
            self._on_reply(reply)

    def _on_reply(self, frame: Frame) -> None:
        _acked, resend = self._table.on_reply(frame)
        for chunk in resend:
            chunk.stream = 0
            chunk.transfer.sent(chunk)
            self._send(chunk.frame_bytes())

    def _enqueue(self, chunks: list[Chunk]) -> None:
        for chunk in chunks:
            if chunk.transfer.cell.status().terminal:
                return
            chunk.stream = 0
            chunk.transfer.sent(chunk)
            self._send(chunk.frame_bytes())

    def submit(self, shipment: Shipment) -> OutboundTransfer:
        if self._closed:
            raise ValueError("channel is closed")
        transfer = OutboundTransfer(shipment, self._enqueue)
        self._table.add(transfer)
        transfer.cell.on_terminal(lambda status: self._ended(transfer, status))
        self._send(transfer.open_frame)
        transfer.start()
        return transfer

    def _ended(self, transfer: OutboundTransfer, status: TransferStatus) -> None:
        if status is not TransferStatus.COMPLETED and not transfer.remote_ended:
            job, attempt = transfer.key
            self._send(encode(Frame(FrameType.CANCEL, job, attempt, payload=str(transfer.error).encode())))

    def close(self) -> None:
        self._closed = True
        for transfer in self._table.live():
            transfer.cancel()
