"""`ShmChannel`: the sending end of the same-host transport (transport/shm_receiver.py).

One Unix control socket to the receiver, the receiver's arena mapped here. Chunks of a
placed shipment (raw codec, room in the arena) are copied from the producer's buffers
straight into the receiver's part buffers by `copy_threads` threads (numpy copies release
the GIL), and only their 64-byte DATA headers go on the socket. Before OPEN_OK says where
a shipment goes, its chunks wait here. Everything else (OPEN, ACK, DONE, CANCEL, ERROR,
tickets, deadlines) is the TCP protocol unchanged.

A broken control socket (the receiver died, or a reply failed its checksum) fails every live
transfer opened on it at once with `PeerUnavailable`: there is no other stream to resend on. The
next `submit` reconnects. So does a send that makes no progress for `send_timeout_s` (a receiver
that stopped reading), and an unexpected error in the channel's own threads: a channel never
leaves its transfers waiting for their deadline on a link nobody serves.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import socket
import threading
import time
from functools import partial

import numpy as np

from prfaas.transport import metrics, sockets
from prfaas.transport.api import Shipment, TransferStatus
from prfaas.transport.errors import FrameError, PeerUnavailable, TransportError
from prfaas.transport.framing import (
    HEADER_SIZE,
    Frame,
    FrameType,
    encode,
    json_payload,
    parse_header,
    payload_ok,
    read_exact,
    to_frame,
)
from prfaas.transport.outbound import Chunk, OutboundTransfer, TransferTable, encoder_pool
from prfaas.transport.shm_receiver import Placement, map_arena
from prfaas.transport.writer import FrameWriter, socket_room

log = logging.getLogger(__name__)
Key = tuple[bytes, int]
SEND_TIMEOUT_S = sockets.SEND_TIMEOUT_S  # a same-host receiver that takes no control bytes this long is stuck
BATCH_CHUNKS = 32  # chunks a copy thread takes from the queue at once (one header write for all)


class _Link:
    """One connected control socket and the mapped arena behind it."""

    def __init__(self, path: str, timeout_s: float, node: str, send_timeout_s: float = SEND_TIMEOUT_S) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout_s)
        try:
            sock.connect(path)
            sock.sendall(encode(Frame(FrameType.HELLO, payload=json_payload({"versions": [1], "node": node}))))
            data, fds, _flags, _addr = socket.recv_fds(sock, HEADER_SIZE, 1)
            if not data:
                raise ConnectionError("receiver closed the connection during HELLO")
            hello = read_reply(sock, bytes(data))  # the rest of the frame whose start came with the fd
            if hello.type is not FrameType.HELLO_OK:
                raise FrameError(f"receiver answered HELLO with {hello.type.name}: {bytes(hello.payload)[:200]!r}")
            body = hello.json()
            if not fds or not isinstance(body, dict) or not isinstance(body.get("arena_bytes"), int):
                raise FrameError("receiver's HELLO_OK carries no arena (is it a shared-memory receiver?)")
            try:
                self.arena = map_arena(fds[0], body["arena_bytes"])
            finally:
                for fd in fds:
                    with contextlib.suppress(OSError):
                        socket.close(fd)
            sock.settimeout(None)  # the reader waits for replies as long as the link lives
            sockets.send_timeout(sock, send_timeout_s)  # but no send waits forever
        except BaseException:
            sock.close()
            raise
        self.sock = sock
        self.alive = True
        self.broken = False  # `ShmChannel._broken` has failed the transfers of this link
        send, send_by = partial(sockets.send_frame, sock), partial(sockets.sendall_by, sock, sock.sendall)
        self.writer = FrameWriter(send, socket_room(sock.fileno), lambda _exc: self.close(), send_by=send_by)

    def send(self, header: bytes, payload: bytes | memoryview = b"") -> None:
        """Write a frame, after any posted one (raises OSError: the link cannot be used again)."""
        self.writer.write(header, payload)

    def post(self, frame: bytes) -> None:
        """A CANCEL from any thread: never waits on a receiver that stopped reading; a failed send closes the link."""
        self.writer.post(frame)

    def drain(self, budget_s: float) -> None:
        """Posted frames (the CANCELs `ShmChannel.close` just caused) out while the receiver reads, for at
        most `budget_s`: closing the socket at once would drop them, and the receiver would keep the
        shipments (and their arena room) until their deadline. Never past `budget_s`: a send that waits for room
        gives up then, however much is queued."""
        self.writer.drain(time.monotonic() + budget_s)  # after a copy thread's write in progress

    def close(self) -> None:
        self.alive = False
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


def read_reply(sock: socket.socket, head: bytes = b"") -> Frame:
    """One frame from the receiver (`head`: its first bytes, if read already). A payload that fails the
    checksum it carries raises FrameError, which breaks the link: a corrupt ACK would acknowledge a chunk
    the receiver never stored."""
    header = parse_header(head + read_exact(sock, HEADER_SIZE - len(head)))
    payload = read_exact(sock, header.payload_len) if header.payload_len else bytearray()
    if header.payload_xxh3 and not payload_ok(header, payload):
        raise FrameError(f"receiver's {header.type.name} frame fails its payload checksum")
    return to_frame(header, payload)


class ShmChannel:
    """A channel to the `ShmReceiver` listening at `path` on this host. Implements `Channel`.

    checksums: write payload_xxh3 on every chunk (the receiver then verifies it); off by
    default: the KV never crosses a wire. copy_threads: threads copying chunks into the arena.
    """

    def __init__(
        self,
        path: str,
        *,
        connect_timeout_s: float = 3.0,
        checksums: bool = False,
        copy_threads: int = 2,
        encode_threads: int = 2,
        node: str = "sender",
        send_timeout_s: float = SEND_TIMEOUT_S,
    ) -> None:
        self.path = path
        self.send_timeout_s = send_timeout_s
        self.peer = f"shm:{path}"  # the metrics' peer label
        self.connect_timeout_s = connect_timeout_s
        self.checksums = checksums
        self.node = node
        self.table = TransferTable()
        self.closed = threading.Event()
        self._lock = threading.Lock()
        self._closing = False  # `close` began (under `_lock`): `submit` refuses, no link is dialled
        self._link: _Link | None = None
        self._opened_on: dict[OutboundTransfer, _Link] = {}  # the link each live transfer's OPEN went on
        self._opening: dict[OutboundTransfer, bytes] = {}  # OPEN not out yet -> the CANCEL to post after it (or b"")
        self._placements: dict[Key, Placement | None] = {}  # None: inline payloads
        self._waiting: dict[Key, list[Chunk]] = {}  # chunks produced before OPEN_OK
        self._queue: queue.SimpleQueue[Chunk | None] = queue.SimpleQueue()
        self._encoder = encoder_pool(encode_threads, "prfaas-shm-encode")
        self._threads = [
            threading.Thread(target=self._copy_loop, name=f"prfaas-shm-copy-{i}", daemon=True)
            for i in range(copy_threads)
        ]
        self._threads.append(threading.Thread(target=self._reap_loop, name="prfaas-shm-sender-reaper", daemon=True))
        for thread in self._threads:
            thread.start()

    # -- Channel ---------------------------------------------------------------------------

    def submit(self, shipment: Shipment) -> OutboundTransfer:
        transfer = OutboundTransfer(shipment, self._enqueue, self._encoder, checksum_payload=self.checksums)
        transfer.cell.on_terminal(lambda status: self._ended(transfer, status))
        with self._lock:  # `close` marks the channel closing under it, then cancels what the table holds
            if self._closing:
                raise PeerUnavailable("channel is closed")
            self.table.add(transfer)
        try:
            link = self._connected()
            with self._lock:  # before its OPEN goes: from now on a break of this link fails it (`_broken`)
                if transfer.cell.status().terminal:
                    return transfer  # canceled meanwhile (`close`): no OPEN of a shipment nobody would cancel
                self._opened_on[transfer] = link
                self._opening[transfer] = b""
            try:
                link.send(transfer.open_frame)
            finally:
                with self._lock:  # ended while its OPEN went out: `_ended` left its CANCEL for after the OPEN
                    cancel = self._opening.pop(transfer)
            if cancel:
                link.post(cancel)
        except (PeerUnavailable, OSError, FrameError, ConnectionError, ValueError) as exc:  # ValueError: mmap refused
            no_receiver = PeerUnavailable(f"no shared-memory receiver at {self.path}: {exc}")
            transfer.cell.finish(TransferStatus.FAILED, exc if isinstance(exc, PeerUnavailable) else no_receiver)
            return transfer  # (PeerUnavailable: closing)
        transfer.start()
        return transfer

    def close(self, timeout_s: float = 5.0) -> None:
        """Cancel live transfers (their CANCELs out first, within 1 s, where the receiver reads), close the
        socket, join every thread, unmap the arena."""
        with self._lock:
            self._closing = True  # no submit gets into the table, nor dials a link, from now on
        for transfer in self.table.live():
            transfer.cancel()
        with self._lock:
            link, self._link = self._link, None  # copy threads send nothing more
        if link is not None:
            link.drain(min(1.0, timeout_s))
        self.closed.set()
        for _ in self._threads:
            self._queue.put(None)
        if link is not None:
            link.close()
        for thread in self._threads:
            thread.join(timeout_s)
        self._encoder.shutdown(wait=True, cancel_futures=True)
        if link is not None:
            with contextlib.suppress(BufferError):
                link.arena.close()

    def __enter__(self) -> ShmChannel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- connection ------------------------------------------------------------------------

    def _connected(self) -> _Link:
        with self._lock:
            if self._closing:
                raise PeerUnavailable("channel is closed")  # a link dialled now would outlive `close`
            if self._link is not None and self._link.alive:
                return self._link
            link = self._link = _Link(self.path, self.connect_timeout_s, self.node, self.send_timeout_s)
        threading.Thread(target=self._read_loop, args=(link,), name="prfaas-shm-reader", daemon=True).start()
        return link

    def _read_loop(self, link: _Link) -> None:
        reason = "shared-memory receiver went away"
        try:
            while True:
                frame = read_reply(link.sock)
                if frame.type is FrameType.OPEN_OK:
                    self._placed((frame.job_id, frame.attempt), frame)
                _acked, resend = self.table.on_reply(frame)
                for chunk in resend:
                    self._queue.put(chunk)
        except (OSError, ConnectionError):
            pass
        except FrameError as exc:  # junk, or a reply that fails its checksum: nothing after it can be trusted
            reason = f"shared-memory control socket: {exc}"
        except Exception as exc:  # a bug here must not leave transfers waiting on a dead reader
            log.exception("shared-memory channel to %s: reply reader failed", self.path)
            reason = f"shared-memory channel reader failed: {exc!r}"
        self._broken(link, reason)

    def _broken(self, link: _Link, reason: str) -> None:
        """The link is unusable: close it (the next submit reconnects) and fail what is live
        on it; one socket carries every transfer, so there is nothing to resend on. Only transfers opened on
        this link: a submit since the close may have opened its own on a new one. Once per link."""
        with self._lock:
            if link.broken:
                return
            link.broken = True
        link.close()
        with self._lock:
            on_link = [transfer for transfer, opened_on in self._opened_on.items() if opened_on is link]
        for transfer in on_link:
            transfer.cell.finish(TransferStatus.FAILED, PeerUnavailable(reason))

    def _placed(self, key: Key, frame: Frame) -> None:
        body, transfer = frame.json() if frame.payload else None, self.table.get(key)
        if transfer is None:
            return  # ended meanwhile
        placement: Placement | None = None
        if isinstance(body, dict) and isinstance(body.get("parts"), list):
            placement = (transfer.spec.chunk_bytes, [(int(k), int(v)) for k, v in body["parts"]])
        with self._lock:
            if key in self._placements:
                return
            self._placements[key] = placement
            waiting = self._waiting.pop(key, [])
        for chunk in waiting:
            self._queue.put(chunk)

    # -- sending ---------------------------------------------------------------------------

    def _enqueue(self, chunks: list[Chunk]) -> None:
        if not chunks:
            return
        transfer = chunks[0].transfer
        with self._lock:
            if transfer.cell.status().terminal:
                return  # encoded after it ended (`_ended` has run or runs next): nothing may keep them
            if transfer.key not in self._placements:
                self._waiting.setdefault(transfer.key, []).extend(chunks)
                return
        for chunk in chunks:
            self._queue.put(chunk)

    def _copy_loop(self) -> None:
        stop = False
        while not stop and (chunk := self._queue.get()) is not None:
            batch = [chunk]
            while len(batch) < BATCH_CHUNKS:  # what is queued already goes out with one write
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    stop = True
                    break
                batch.append(more)
            try:
                self._send_batch(batch)
            except Exception as exc:  # a bug here must not strand the queued chunks silently
                log.exception("shared-memory channel to %s: copy thread failed", self.path)
                if (link := self._link) is not None:  # (one read of a reference: no lock needed)
                    self._broken(link, f"shared-memory channel copy failed: {exc!r}")

    def _send_batch(self, batch: list[Chunk]) -> None:
        with self._lock:
            link = self._link
        if link is None or not link.alive:
            return  # the reader fails the transfers
        headers: list[bytes] = []
        try:
            for chunk in batch:
                transfer = chunk.transfer
                if transfer.cell.status().terminal:
                    continue
                with self._lock:
                    placement = self._placements.get(transfer.key)
                    opened_on = self._opened_on.get(transfer)
                if opened_on is not link:
                    continue  # opened on a link that broke (`_broken` fails it): its DATA means nothing on this one
                chunk.stream = 0
                transfer.sent(chunk)
                if placement is None:
                    link.send(chunk.header, chunk.payload)
                    continue
                try:
                    self._place(link, placement, chunk)
                except TransportError as exc:
                    transfer.cell.finish(TransferStatus.FAILED, exc)
                    continue
                headers.append(chunk.header)
            if headers:
                link.send(b"".join(headers))
        except OSError as exc:  # closed, or no progress for send_timeout_s: the receiver is stuck
            self._broken(link, f"shared-memory control socket: {exc}")

    @staticmethod
    def _place(link: _Link, placement: Placement, chunk: Chunk) -> None:
        """Copy the chunk to where the receiver placed it: the KV's one copy."""
        chunk_bytes, offsets = placement
        layer, part, index = chunk.key
        start = offsets[layer][part] + index * chunk_bytes
        size = len(chunk.payload)
        if not 0 <= start <= start + size <= len(link.arena):
            raise TransportError(f"receiver placed layer {layer} part {part} outside its arena")
        target = np.frombuffer(link.arena, dtype=np.uint8, count=size, offset=start)
        np.copyto(target, np.frombuffer(chunk.payload, dtype=np.uint8))  # releases the GIL
        del target

    def _ended(self, transfer: OutboundTransfer, status: TransferStatus) -> None:
        metrics.TRANSFERS.labels(self.peer, status.value).inc()
        metrics.WIRE_BYTES.labels(self.peer).inc(transfer.stats.wire_bytes)
        if status is TransferStatus.COMPLETED:
            metrics.RAW_BYTES.labels(self.peer, transfer.spec.codec).inc(transfer.spec.raw_bytes)
        key = transfer.key
        with self._lock:
            placed = key in self._placements
            self._placements.pop(key, None)
            waiting = len(self._waiting.pop(key, []))
            link = self._opened_on.pop(transfer, None)  # only the connection that opened it may cancel it
        if status is TransferStatus.TIMEOUT:  # should not happen on one host: say what was stuck
            log.warning(
                "shared-memory shipment %s attempt %d timed out: accepted=%s placed=%s waiting_for_open_ok=%d "
                "unacked=%d queued=%d link_alive=%s threads_alive=%d/%d",
                transfer.spec.job_id, transfer.spec.attempt, transfer.accepted, placed, waiting,
                transfer.unacked, self._queue.qsize(), link is not None and link.alive,
                sum(t.is_alive() for t in self._threads), len(self._threads),
            )  # fmt: skip
        if status is not TransferStatus.COMPLETED and not transfer.remote_ended and link is not None and link.alive:
            cancel = encode(Frame(FrameType.CANCEL, key[0], key[1], payload=str(transfer.error).encode()[:1000]))
            with self._lock:  # before its OPEN, it would cancel nothing: `submit` posts it once the OPEN is out
                if transfer in self._opening:
                    self._opening[transfer], cancel = cancel, b""
            if cancel:
                link.post(cancel)
        transfer.drop_unacked()

    def _reap_loop(self) -> None:
        while not self.closed.wait(0.05):
            link = self._link
            if link is not None and link.alive:
                link.writer.flush()  # a CANCEL posted while the receiver did not read: out once it does
            for transfer in self.table.live():
                transfer.cell.expire_if_due()
