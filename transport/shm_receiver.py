"""The shared-memory receiver: the same-host transport, KV written once into its memory.

A decode process and a prefill process on one host (one region's node) do not need TCP:
the receiver owns an **arena**, a memfd mapped into both processes (handed to each sender
over the control socket with SCM_RIGHTS, so no name in /dev/shm can leak), and allocates
every raw-codec part buffer of a shipment there at OPEN. Its OPEN_OK tells the sender where
each part lives; the sender copies each chunk from the producer's buffer straight into
place (the only copy of the KV) and sends the DATA header alone on the Unix control
socket. The receiver's layers are views of the arena: nothing is copied on its side.
Frames, tickets, receiver rules and the `Transfer` API are those of TCP (docs/transports.md
gives the three differences); codecs other than raw, or a full arena, fall back to payloads
inline on the control socket.

Checksums: by default the sender leaves payload_xxh3 0 (the bytes never cross a wire; a
memcpy within one host is as trustworthy as the receiver's own memory) and the receiver
verifies every payload that carries one (`ShmChannel(checksums=True)`).

Lifetime: arena memory comes back when `Inbound.release()` is called (copy the KV into the
engine first) or when the shipment fails; freed ranges wait `QUARANTINE_S` before reuse,
so a sender still copying into a canceled shipment cannot touch a later one's KV.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import select
import socket
import struct
import tempfile
import uuid

from prfaas.transport import sockets
from prfaas.transport.admission import ReceiverLimits
from prfaas.transport.arena import POPULATE, Arena
from prfaas.transport.codecs import DTYPE_SIZES, CodecId
from prfaas.transport.endpoints import Endpoint, host_id
from prfaas.transport.errors import FrameError
from prfaas.transport.framing import (
    ChunkKey,
    Frame,
    FrameType,
    Header,
    ack_payload,
    encode,
    json_payload,
    parse_ack,
    payload_ok,
    read_exact,
    to_frame,
)
from prfaas.transport.open_info import OpenInfo
from prfaas.transport.receiver_base import FrameConnection, ListeningReceiver, Payload
from prfaas.transport.receiver_core import Discard, ReceiverCore
from prfaas.transport.tickets import TicketVerifier

log = logging.getLogger(__name__)
MAX_PLACEMENTS = 4096  # arena placements a connection keeps; one per shipment it opened, pruned of ended ones past this
Key = tuple[bytes, int]
Placement = tuple[int, list[tuple[int, int]]]  # (chunk_bytes, [(k offset, v offset) per layer]) in the arena


def default_socket_path(node: str) -> str:
    return os.path.join(tempfile.gettempdir(), f"prfaas-kv-{node}-{uuid.uuid4().hex[:8]}.sock")


class ShmConnection(FrameConnection):
    """One sender's control socket on the receiver."""

    thread_name = "prfaas-shm-conn"

    def __init__(self, sock: socket.socket, receiver: ShmReceiver) -> None:
        super().__init__(sock, receiver.core, receiver.limits)
        self.unix = sock
        self.rx = receiver
        self.placed: dict[Key, Placement] = {}

    def serve(self) -> None:
        header = self.next_header()
        payload = read_exact(self.sock, header.payload_len) if header.payload_len else bytearray()
        for reply in self.core.handle(to_frame(header, payload), payload_ok(header, payload), self.session):
            body = reply.json() if reply.type is FrameType.HELLO_OK else None
            if isinstance(body, dict):  # HELLO_OK carries the arena: its size, and its fd beside it
                body["arena_bytes"] = self.rx.arena.size
                hello_ok = encode(Frame(FrameType.HELLO_OK, payload=json_payload(body)))
                with self._write_lock:  # a failed send ends the connection (raises)
                    socket.send_fds(self.unix, [hello_ok], [self.rx.arena.fd])
            else:
                self.send(reply)
        replies: list[Frame] = []
        while True:
            replies += self._frame(self.next_header())
            if len(replies) >= 64 or not self._readable():
                self._flush(replies)  # nothing more to read now: answer all at once
                replies = []

    def _readable(self) -> bool:
        try:
            return bool(select.select([self.unix], [], [], 0)[0])
        except ValueError:  # fd -1: a failed send on another thread closed the socket
            raise ConnectionError("control socket closed") from None

    def _flush(self, replies: list[Frame]) -> None:
        """Send replies, the ACKs of each shipment merged into one frame, in one write."""
        acks: dict[Key, list[ChunkKey]] = {}
        out: list[Frame] = []
        for reply in replies:
            if reply.type is FrameType.ACK:
                key = (reply.job_id, reply.attempt)
                if key not in acks:
                    acks[key] = []
                    out.append(reply)  # stands in for the merged ACK
                acks[key] += parse_ack(reply.payload)
            else:
                out.append(reply)
        data = b"".join(
            encode(Frame(FrameType.ACK, f.job_id, f.attempt, payload=ack_payload(acks[(f.job_id, f.attempt)])))
            if f.type is FrameType.ACK
            else encode(f)
            for f in out
        )
        if data:
            self.write(data)

    def _frame(self, header: Header) -> list[Frame]:
        key = (header.job_id, header.attempt)
        if header.type is FrameType.DATA and key in self.placed:
            return self._placed_data(header, self.placed[key])
        return self.receive(header)  # an inline payload (not raw, or no room in the arena) straight into place

    def verify(self, header: Header, payload: Payload) -> bool:
        """A payload checksum of 0 means the sender wrote none (never on a wire); else verify it."""
        return header.payload_xxh3 == 0 or payload_ok(header, payload)

    def handled(self, header: Header, payload: bytearray, replies: list[Frame]) -> list[Frame]:
        # A placement outlives its shipment's CANCEL: the sender's copy threads may still write DATA headers of
        # it, whose payloads are in the arena; read as inline, they would desync the socket (pruned past
        # MAX_PLACEMENTS, oldest ended first)
        if header.type is FrameType.OPEN and [r.type for r in replies] == [FrameType.OPEN_OK]:
            return [self._place(header, payload)]
        return replies

    def _place(self, header: Header, payload: bytearray) -> Frame:
        """OPEN accepted: allocate a raw shipment's parts in the arena and say where they are
        (OPEN_OK's payload); an empty OPEN_OK means payloads come inline."""
        job, attempt = header.job_id, header.attempt
        info, _ticket = OpenInfo.from_json(to_frame(header, payload).json())
        if info.codec != CodecId.RAW:
            return Frame(FrameType.OPEN_OK, job, attempt)
        offsets: list[tuple[int, int]] = []
        for layer, (heads, tokens, head_dim) in enumerate(info.layer_shapes):
            raw_len = heads * tokens * head_dim * DTYPE_SIZES[info.dtype]
            count = max(1, -(-raw_len // info.chunk_bytes))
            pair = []
            for part in (0, 1):  # chunk 0's slot creates the part buffer; the claim is dropped at once
                probe = Header(FrameType.DATA, job, attempt, layer, part, int(CodecId.RAW), 0, count, raw_len,
                               min(raw_len, info.chunk_bytes), 0)  # fmt: skip
                view = self.core.data_slot(probe, self.session)
                offset = self.rx.arena.offset_of(view) if isinstance(view, memoryview) else None
                if isinstance(view, memoryview):
                    self.core.data_commit(probe, False, self.session)
                if offset is None:
                    return Frame(FrameType.OPEN_OK, job, attempt)  # heap part (arena full): inline
                pair.append(offset)
            offsets.append((pair[0], pair[1]))
        self.placed[(job, attempt)] = (info.chunk_bytes, offsets)
        if len(self.placed) > MAX_PLACEMENTS:  # the oldest ended ones: no DATA of theirs is still on its way
            opened = set(self.session.opened)
            for key in [k for k in self.placed if k not in opened][: len(self.placed) - MAX_PLACEMENTS]:
                del self.placed[key]
        return Frame(FrameType.OPEN_OK, job, attempt, payload=json_payload({"parts": offsets}))

    def _placed_data(self, header: Header, placement: Placement) -> list[Frame]:
        """A DATA header whose payload the sender already wrote at its place in the arena."""
        chunk_bytes, offsets = placement
        if not 0 <= header.layer < len(offsets):
            return self.core.handle(to_frame(header, b""), False, self.session)  # the core refuses it
        start = offsets[header.layer][header.part] + header.chunk * chunk_bytes
        view = self.core.data_slot(header, self.session)
        if isinstance(view, Discard):  # unknown, ended or duplicate: the payload in the arena is not read
            return view.replies
        if view is not None:
            if self.rx.arena.offset_of(view) != start:  # cannot happen while parts stay put; refuse loudly
                self.core.data_commit(header, False, self.session)
                raise FrameError("placed chunk is not where OPEN_OK said")
            return self.core.data_commit(header, self.verify(header, view), self.session)
        in_place = self.rx.arena.view(start, header.payload_len)  # duplicate, ended, unknown: the core decides
        return self.core.handle(to_frame(header, in_place), self.verify(header, in_place), self.session)


class ShmReceiver(ListeningReceiver[ShmConnection]):
    """The receiving end: a Unix control socket at `path` and an arena of `arena_bytes`.

    Senders on this host connect with `ShmChannel(receiver.path)`. `expect` / `Inbound` as
    for TCP; the layers of a raw shipment are memoryviews of the arena, valid until
    `Inbound.release()`. `close()` cancels expected shipments (unless `core` was given),
    stops listening, closes connections, joins threads, then unmaps the arena.
    """

    def __init__(
        self,
        verifier: TicketVerifier,
        path: str | None = None,
        *,
        node: str = "receiver",
        arena_bytes: int = 512 << 20,
        arena: Arena | None = None,
        core: ReceiverCore | None = None,
        reap_interval_s: float = 0.05,
        send_timeout_s: float = 10.0,
        limits: ReceiverLimits | None = None,
    ) -> None:
        self.send_timeout_s = send_timeout_s
        self.arena = arena if arena is not None else Arena(arena_bytes)
        # `core`: share another receiver's expectations (a decode region's TCP port and this
        # one accept the same shipments); give it this arena as its pool, or nothing is placed
        owns_core = core is None
        core = core if core is not None else ReceiverCore(verifier, node, pool=self.arena)
        self.path = path or default_socket_path(node)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)  # a stale socket file of an earlier run
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(self.path)
        listener.listen(64)
        super().__init__(
            listener, core, name="shm", reap_interval_s=reap_interval_s, owns_core=owns_core, limits=limits
        )

    @property
    def endpoint(self) -> str:
        """What a decode region advertises for it (transport/endpoints.py)."""
        return str(Endpoint("shm", path=self.path, host_id=host_id()))

    def connection(self, sock: socket.socket) -> ShmConnection:
        sockets.send_timeout(sock, self.send_timeout_s)  # a sender that stops reading is dropped
        connection = ShmConnection(sock, self)
        with contextlib.suppress(OSError):  # the sending process, as the kernel names it: what max_per_peer counts
            pid, _uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
            if pid > 0:  # 0: a process in a PID namespace this one cannot see (not one shared name for all)
                connection.session.peer = f"pid:{pid}"
        return connection

    def _stop_accepting(self) -> None:
        super()._stop_accepting()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def _release(self, timeout_s: float) -> None:
        self.arena.close()


def map_arena(fd: int, size: int) -> mmap.mmap:
    """A sender's mapping of the receiver's arena (the fd may be closed afterwards)."""
    return mmap.mmap(fd, size, flags=POPULATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
