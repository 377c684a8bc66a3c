import contextlib
import socket
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prfaas.transport.errors import FrameError, UnsupportedVersion
from prfaas.transport.framing import (
    HEADER_SIZE,
    Frame,
    FrameType,
    ack_payload,
    encode,
    job_bytes,
    parse,
    parse_ack,
    read_frame,
)

JOB = job_bytes("0b7c6a0e-5f43-4a53-9a43-2f1d0d0f7a11")


@pytest.mark.parametrize("frame_type", list(FrameType))
def test_every_frame_type_roundtrips(frame_type: FrameType) -> None:
    chunk_count = 3 if frame_type is FrameType.DATA else 0
    frame = Frame(frame_type, JOB, 7, layer=5, part=1, codec=2, chunk=2 if chunk_count else 0,
                  chunk_count=chunk_count, raw_len=1000, payload=b"x" * 33)  # fmt: skip
    data = encode(frame)
    assert len(data) == HEADER_SIZE + 33
    parsed, ok = parse(data)
    assert ok
    assert (parsed.type, parsed.job_id, parsed.attempt, parsed.key, parsed.codec, parsed.raw_len) == (
        frame_type, JOB, 7, frame.key, 2, 1000,
    )  # fmt: skip
    assert bytes(parsed.payload) == b"x" * 33


def test_header_is_64_bytes_as_documented() -> None:
    assert HEADER_SIZE == 64


def test_flipped_payload_byte_is_detected_but_framing_survives() -> None:
    data = bytearray(encode(Frame(FrameType.DATA, JOB, 1, chunk_count=1, payload=b"kv" * 100)))
    data[HEADER_SIZE + 10] ^= 0x40
    frame, ok = parse(bytes(data))
    assert not ok
    assert frame.type is FrameType.DATA


@pytest.mark.parametrize("index", [0, 5, 9, 30, 48, 59, 60])
def test_flipped_header_byte_is_a_frame_error(index: int) -> None:
    data = bytearray(encode(Frame(FrameType.DATA, JOB, 1, chunk_count=1, payload=b"kv")))
    data[index] ^= 0x01
    with pytest.raises(FrameError):
        parse(bytes(data))


def test_unknown_version_is_named() -> None:
    data = bytearray(encode(Frame(FrameType.HELLO)))
    data[4] = 9
    # recompute the header checksum so only the version is wrong
    import xxhash

    data[60:64] = struct.pack("<I", xxhash.xxh32_intdigest(bytes(data[:60])))
    with pytest.raises(UnsupportedVersion, match="wire version 9 not supported"):
        parse(bytes(data))


def test_ack_payload_roundtrip() -> None:
    keys = [(0, 0, 0), (31, 1, 7), (2**31, 0, 2**32 - 1)]
    assert parse_ack(ack_payload(keys)) == keys
    with pytest.raises(FrameError):
        parse_ack(b"\0" * 13)


def test_job_id_must_be_a_uuid() -> None:
    with pytest.raises(FrameError, match="not a UUID"):
        job_bytes("job-42")


@settings(max_examples=500, deadline=None)
@given(st.binary(min_size=0, max_size=200))
def test_parser_on_arbitrary_bytes_raises_frame_error_only(data: bytes) -> None:
    with contextlib.suppress(FrameError):
        parse(data)


@settings(max_examples=100, deadline=None)
@given(st.binary(min_size=0, max_size=300))
def test_reading_arbitrary_bytes_from_a_socket_never_hangs(data: bytes) -> None:
    a, b = socket.socketpair()
    with a, b:
        b.settimeout(2.0)
        a.sendall(data)
        a.shutdown(socket.SHUT_WR)
        with pytest.raises((FrameError, ConnectionError)):  # noqa: PT012
            while True:  # valid frames may appear by chance; the stream must end in an error
                read_frame(b)
