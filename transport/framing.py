"""Frames of the KV wire format, version 1 (docs/wire-format.md): encode, parse, read.

Pure byte handling: no sockets beyond `read_frame`, which reads one frame from any object
with `recv_into` and never waits longer than the socket's own timeout.
"""

from __future__ import annotations

import json
import struct
import uuid
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, Protocol

import xxhash

from prfaas.transport.errors import FrameError, UnsupportedVersion

MAGIC = b"PFKW"
VERSION = 1
SUPPORTED_VERSIONS = (1,)
HEADER = struct.Struct("<4sBBH16sIIBBHIIIIQI")
HEADER_SIZE = HEADER.size  # 64
MAX_PAYLOAD = 16 << 20
ZERO_JOB = bytes(16)
ACK_ENTRY = struct.Struct("<IB3xI")


class FrameType(IntEnum):
    HELLO = 1
    HELLO_OK = 2
    OPEN = 3
    OPEN_OK = 4
    DATA = 5
    ACK = 6
    NACK = 7
    DONE = 8
    CANCEL = 9
    ERROR = 10
    PING = 11
    PONG = 12


class ErrorCode:
    UNSUPPORTED_VERSION = "UNSUPPORTED_VERSION"
    BAD_FRAME = "BAD_FRAME"
    TICKET_REJECTED = "TICKET_REJECTED"
    UNKNOWN_SHIPMENT = "UNKNOWN_SHIPMENT"
    OVER_BUDGET = "OVER_BUDGET"
    DEADLINE = "DEADLINE"
    INTERNAL = "INTERNAL"
    PEER_REFUSED = "PEER_REFUSED"  # a TLS peer whose certificate names no prefill identity (then closed)


ChunkKey = tuple[int, int, int]  # (layer, part, chunk)


@dataclass(frozen=True)
class Frame:
    type: FrameType
    job_id: bytes = ZERO_JOB  # 16 raw bytes
    attempt: int = 0
    layer: int = 0
    part: int = 0
    codec: int = 0
    chunk: int = 0
    chunk_count: int = 0
    raw_len: int = 0
    payload: bytes | bytearray | memoryview = b""

    @property
    def key(self) -> ChunkKey:
        return (self.layer, self.part, self.chunk)

    def json(self) -> Any:
        try:
            return json.loads(bytes(self.payload))
        except (ValueError, RecursionError) as exc:  # not UTF-8, not JSON, an integer past Python's digit limit,
            # or nested past the parser's depth (4 KiB of "[")
            raise FrameError(f"{self.type.name} payload is not JSON: {exc}") from None


def job_bytes(job_id: str) -> bytes:
    """A job's UUID string as the 16 bytes of the header's job_id field."""
    try:
        return uuid.UUID(job_id).bytes
    except ValueError:
        raise FrameError(f"job id {job_id!r} is not a UUID") from None


def encode_header(frame: Frame, *, checksum_payload: bool = True) -> bytes:
    """The 64-byte header. `checksum_payload=False` leaves payload_xxh3 0: only for a
    transport whose payloads never cross a wire (shared memory, docs/transports.md)."""
    payload_len = len(frame.payload)
    if payload_len > MAX_PAYLOAD:
        raise FrameError(f"payload of {payload_len} bytes exceeds the {MAX_PAYLOAD}-byte frame limit")
    checksum = xxhash.xxh3_64_intdigest(frame.payload) if payload_len and checksum_payload else 0
    head = HEADER.pack(
        MAGIC, VERSION, int(frame.type), 0, frame.job_id, frame.attempt, frame.layer, frame.part, frame.codec, 0,
        frame.chunk, frame.chunk_count, frame.raw_len, payload_len, checksum, 0,
    )  # fmt: skip
    return head[:60] + struct.pack("<I", xxhash.xxh32_intdigest(head[:60]))


def encode(frame: Frame) -> bytes:
    return encode_header(frame) + bytes(frame.payload)


@dataclass(frozen=True)
class Header:
    type: FrameType
    job_id: bytes
    attempt: int
    layer: int
    part: int
    codec: int
    chunk: int
    chunk_count: int
    raw_len: int
    payload_len: int
    payload_xxh3: int


def parse_header(data: bytes | bytearray | memoryview) -> Header:
    """Validate and unpack a 64-byte header. Raises FrameError / UnsupportedVersion."""
    if len(data) != HEADER_SIZE:
        raise FrameError(f"frame header is {len(data)} bytes, expected {HEADER_SIZE}")
    fields = HEADER.unpack(data)
    magic, version, ftype, flags, job, attempt, layer, part, codec, _res, chunk, count, raw, plen, pcs, hcs = fields
    if magic != MAGIC:
        raise FrameError(f"bad frame magic {bytes(magic)!r}, expected {MAGIC!r}")
    if xxhash.xxh32_intdigest(bytes(data[:60])) != hcs:
        raise FrameError("frame header checksum mismatch")
    if version not in SUPPORTED_VERSIONS:
        raise UnsupportedVersion(f"wire version {version} not supported; this build speaks {list(SUPPORTED_VERSIONS)}")
    if flags != 0:
        raise FrameError(f"unknown frame flags {flags:#06x}")
    try:
        frame_type = FrameType(ftype)
    except ValueError:
        raise FrameError(f"unknown frame type {ftype}") from None
    if plen > MAX_PAYLOAD:
        raise FrameError(f"payload length {plen} exceeds the {MAX_PAYLOAD}-byte frame limit")
    if part > 1:
        raise FrameError(f"part {part} is neither K (0) nor V (1)")
    if frame_type is FrameType.DATA and not chunk < count:
        raise FrameError(f"chunk {chunk} out of range for chunk_count {count}")
    return Header(frame_type, job, attempt, layer, part, codec, chunk, count, raw, plen, pcs)


def payload_ok(header: Header, payload: bytes | bytearray | memoryview) -> bool:
    expected = xxhash.xxh3_64_intdigest(payload) if header.payload_len else 0
    return expected == header.payload_xxh3


def to_frame(header: Header, payload: bytes | bytearray | memoryview) -> Frame:
    return Frame(
        header.type, header.job_id, header.attempt, header.layer, header.part, header.codec,
        header.chunk, header.chunk_count, header.raw_len, payload,
    )  # fmt: skip


def parse(data: bytes | memoryview) -> tuple[Frame, bool]:
    """One whole frame from `data` (header + payload exactly): (frame, payload checksum ok)."""
    header = parse_header(memoryview(data)[:HEADER_SIZE])
    payload = memoryview(data)[HEADER_SIZE:]
    if len(payload) != header.payload_len:
        raise FrameError(f"frame payload is {len(payload)} bytes, header says {header.payload_len}")
    return to_frame(header, payload), payload_ok(header, payload)


class Readable(Protocol):
    def recv_into(self, buffer: memoryview, nbytes: int = ..., /) -> int: ...


def read_exact(sock: Readable, size: int) -> bytearray:
    buf = bytearray(size)
    read_into(sock, memoryview(buf))
    return buf


def read_into(sock: Readable, view: memoryview) -> None:
    """Fill `view` from the socket (ConnectionError if the peer closes first)."""
    size, got = len(view), 0
    while got < size:
        n = sock.recv_into(view[got:], size - got)
        if n == 0:
            raise ConnectionError(f"connection closed after {got} of {size} bytes")
        got += n


def read_frame(sock: Readable, head: bytes = b"") -> tuple[Frame, bool]:
    """Read one frame: (frame, payload checksum ok); `head`: its first bytes, if read already.
    Raises FrameError on a bad header, ConnectionError when the peer closes, and whatever the
    socket raises on timeout."""
    header = parse_header(head + read_exact(sock, HEADER_SIZE - len(head)))
    payload = read_exact(sock, header.payload_len) if header.payload_len else bytearray()
    return to_frame(header, payload), payload_ok(header, payload)


def ack_payload(keys: list[ChunkKey]) -> bytes:
    return b"".join(ACK_ENTRY.pack(layer, part, chunk) for layer, part, chunk in keys)


def parse_ack(payload: bytes | bytearray | memoryview) -> list[ChunkKey]:
    if len(payload) % ACK_ENTRY.size:
        raise FrameError(f"ACK payload of {len(payload)} bytes is not a multiple of {ACK_ENTRY.size}")
    return [ACK_ENTRY.unpack_from(payload, off) for off in range(0, len(payload), ACK_ENTRY.size)]


def json_payload(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


def error_frame(code: str, message: str, job_id: bytes = ZERO_JOB, attempt: int = 0) -> Frame:
    return Frame(FrameType.ERROR, job_id, attempt, payload=json_payload({"code": code, "message": message}))
