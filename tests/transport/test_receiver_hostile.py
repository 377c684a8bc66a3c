"""A KV receiver against a peer that means harm, or is merely late, on real sockets with raw frames: a
chunk still being read when its shipment ends never lands in a later shipment's memory, a connection
cannot cancel a shipment it did not open, malformed JSON gets an ERROR frame (not a dead thread), and a
shape cannot size the receiver's memory at will."""

from __future__ import annotations

import base64
import contextlib
import json
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from transport_kit import KEY

from prfaas.transport import kvquant
from prfaas.transport.api import TransferStatus
from prfaas.transport.arena import Arena
from prfaas.transport.codecs import CodecId, TensorMeta, _compress, _pack
from prfaas.transport.errors import FrameError
from prfaas.transport.framing import Frame, FrameType, encode, job_bytes, json_payload, read_frame
from prfaas.transport.open_info import MAX_LAYERS, OpenInfo
from prfaas.transport.tcp_receiver import TcpReceiver
from prfaas.transport.tickets import TicketSigner, TicketVerifier

SIGNER = TicketSigner({"k1": KEY}, "k1")
VERIFIER = TicketVerifier({"k1": KEY})


def _connect(receiver: TcpReceiver) -> socket.socket:
    sock = socket.create_connection(receiver.address)
    sock.settimeout(10)
    sock.sendall(encode(Frame(FrameType.HELLO, payload=json_payload({"versions": [1]}))))
    assert read_frame(sock)[0].type is FrameType.HELLO_OK
    return sock


def _open(sock: socket.socket, job: str, shapes: list[tuple[int, int, int]], chunk_bytes: int, **fields: Any) -> Frame:
    raw = sum(2 * h * t * d * 2 for h, t, d in shapes)
    body = {"ticket": SIGNER.issue(job, 1, "acme", raw, ttl_s=60), "num_layers": len(shapes), "dtype": "bfloat16",
            "layer_shapes": [list(s) for s in shapes], "codec": 0, "chunk_bytes": chunk_bytes} | fields  # fmt: skip
    sock.sendall(encode(Frame(FrameType.OPEN, job_bytes(job), 1, payload=json_payload(body))))
    frame: Frame = read_frame(sock)[0]
    return frame


def _data(job: str, part: int, raw_len: int, payload: bytes, codec: int = 0) -> bytes:
    return encode(Frame(FrameType.DATA, job_bytes(job), 1, 0, part, codec, 0, 1, raw_len, payload))


@pytest.fixture
def errors() -> Iterator[list[str]]:
    """Exceptions that end a receiver thread."""
    seen: list[str] = []
    previous = threading.excepthook
    threading.excepthook = lambda args: seen.append(f"{args.exc_type.__name__}: {args.exc_value}")
    yield seen
    threading.excepthook = previous


def test_a_chunk_read_when_its_shipment_ended_never_lands_in_a_later_shipments_memory() -> None:
    """Shipment 1's connection has sent half a chunk when the decode side cancels it; shipment 2 then
    takes arena memory (past the quarantine) and completes; the rest of the stale chunk arrives. Shipment
    2's KV is untouched, and shipment 1's buffer goes back to the arena once that read ended."""
    arena = Arena(1 << 20, quarantine_s=0.1)
    receiver = TcpReceiver(VERIFIER, pool=arena)
    shape, raw = (1, 2048, 64), 2048 * 64 * 2  # one 256 KiB chunk per part
    first, second = str(uuid.uuid4()), str(uuid.uuid4())
    try:
        stale_inbound = receiver.expect(first, 1, 30)
        late = _connect(receiver)
        assert _open(late, first, [shape], raw).type is FrameType.OPEN_OK
        stale = _data(first, 0, raw, b"\xee" * raw)
        late.sendall(stale[: 64 + 1000])  # the header and 1,000 bytes: the chunk is claimed, its read waits
        time.sleep(0.3)
        stale_inbound.cancel("canceled by the decode side")
        time.sleep(0.3)  # past the arena's quarantine
        inbound = receiver.expect(second, 1, 30)
        sock = _connect(receiver)
        assert _open(sock, second, [shape], raw).type is FrameType.OPEN_OK
        for part in (0, 1):
            sock.sendall(_data(second, part, raw, b"\x11" * raw))
        assert inbound.wait(5) is TransferStatus.COMPLETED
        k, _v = inbound.layer(0, 5)
        late.sendall(stale[64 + 1000 :])  # the rest of the stale chunk
        assert read_frame(late)[0].type in (FrameType.CANCEL, FrameType.ERROR, FrameType.ACK)
        time.sleep(0.2)
        assert bytes(k) == b"\x11" * raw
        assert not stale_inbound._draining  # its part went back once the read ended
    finally:
        receiver.close()


def test_a_connection_cannot_cancel_a_shipment_it_did_not_open() -> None:
    receiver = TcpReceiver(VERIFIER)
    job = str(uuid.uuid4())
    try:
        inbound = receiver.expect(job, 1, 30)
        owner = _connect(receiver)
        assert _open(owner, job, [(1, 64, 64)], 4096).type is FrameType.OPEN_OK
        stranger = _connect(receiver)
        stranger.sendall(encode(Frame(FrameType.CANCEL, job_bytes(job), 1, payload=b"not yours")))
        time.sleep(0.3)
        assert not inbound.status().terminal
        owner.sendall(encode(Frame(FrameType.CANCEL, job_bytes(job), 1, payload=b"mine")))
        assert inbound.wait(5).terminal and "mine" in str(inbound.error)
    finally:
        receiver.close()


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


BASE = {"ticket": "x", "num_layers": 1, "dtype": "bfloat16", "layer_shapes": [[1, 1, 1]], "codec": 0,
        "chunk_bytes": 4096}  # fmt: skip
UNSIGNED_KID = _b64(json.dumps({"job": "j", "attempt": 1, "tenant": "t", "budget": 1, "exp": 1e12, "nonce": "n",
                                "kid": []}).encode()) + "." + _b64(b"x" * 32)  # fmt: skip


@pytest.mark.parametrize(
    ("hello", "open_payload"),
    [
        (b'{"versions":5}', None),
        (b'{"versions":[[1]]}', None),
        (None, json.dumps(BASE | {"dtype": []}).encode()),
        (None, json.dumps(BASE).replace("[[1, 1, 1]]", "[[1, 1, Infinity]]").encode()),
        (None, json.dumps(BASE).replace('"codec": 0', '"codec": ' + "9" * 5000).encode()),
        (None, json.dumps(BASE | {"ticket": UNSIGNED_KID}).encode()),
        (b"[" * 4000, None),  # fits the 4 KiB a connection may send before HELLO; nested past the parser's depth
        (None, b'{"ticket": ' + b"[" * 4000),
    ],
    ids=[
        "versions-int",
        "versions-nested",
        "dtype-list",
        "infinity",
        "5000-digits",
        "kid-list",
        "deep-hello",
        "deep-open",
    ],
)
def test_malformed_json_gets_an_error_frame_not_a_dead_thread(
    errors: list[str], hello: bytes | None, open_payload: bytes | None
) -> None:
    receiver = TcpReceiver(VERIFIER)
    job = str(uuid.uuid4())
    try:
        receiver.expect(job, 1, 30)
        sock = socket.create_connection(receiver.address)
        sock.settimeout(10)
        sock.sendall(encode(Frame(FrameType.HELLO, payload=hello or json_payload({"versions": [1]}))))
        reply = read_frame(sock)[0]
        if open_payload is not None:
            assert reply.type is FrameType.HELLO_OK
            sock.sendall(encode(Frame(FrameType.OPEN, job_bytes(job), 1, payload=open_payload)))
            reply = read_frame(sock)[0]
        assert reply.type is FrameType.ERROR
        time.sleep(0.1)
        assert errors == []
    finally:
        receiver.close()


def test_a_kv_codec_shape_cannot_size_the_values_rotation() -> None:
    """A 67-byte kv8 payload for one token of head_dim 8192 would build (and cache) a 256 MiB rotation
    matrix; the codec refuses head_dim past kvquant.MAX_HEAD_DIM with a typed error instead."""
    receiver = TcpReceiver(VERIFIER)
    job = str(uuid.uuid4())
    shape = (1, 1, 8192)
    try:
        inbound = receiver.expect(job, 1, 30)
        sock = _connect(receiver)
        assert _open(sock, job, [shape], 4096, codec=int(CodecId.KV8)).type is FrameType.OPEN_OK
        cached = kvquant.hadamard.cache_info().currsize
        # a well-formed kv8 values payload (one bf16 scale of 1.0, the codes), as a hostile sender builds it:
        # the codec's own encoder refuses this shape
        payload = _pack(CodecId.KV8, TensorMeta("bfloat16", shape, 1), b"\x80\x3f", _compress(bytes([63]) * 8192, 1))
        assert len(payload) < 100
        sock.sendall(_data(job, 1, 8192 * 2, payload, codec=int(CodecId.KV8)))
        assert inbound.wait(5).terminal and "head_dim" in str(inbound.error)
        assert kvquant.hadamard.cache_info().currsize == cached
    finally:
        receiver.close()


def test_an_open_announcing_more_layers_than_any_model_has_is_refused() -> None:
    """Every layer part takes a buffer of its own: an OPEN may not announce thousands of tiny ones."""
    body = BASE | {"num_layers": MAX_LAYERS + 1, "layer_shapes": [[1, 1, 1]] * (MAX_LAYERS + 1)}
    with pytest.raises(FrameError, match=f"more than {MAX_LAYERS}"):
        OpenInfo.from_json(body)
    OpenInfo.from_json(body | {"num_layers": MAX_LAYERS, "layer_shapes": [[1, 1, 1]] * MAX_LAYERS})


def test_a_sender_that_stops_reading_never_blocks_the_thread_that_ends_its_shipment() -> None:
    """A prefill process wedged (or hostile) with its connection open stops reading its replies: the
    receiver's writes to it wait on a full socket. Ending one of its shipments (the decode engine's cancel,
    the reaper at a deadline, close) must not wait on that socket: the end frame is left for the connection."""
    receiver = TcpReceiver(VERIFIER)
    job = str(uuid.uuid4())
    inbound = receiver.expect(job, 1, 60)
    other = receiver.expect(str(uuid.uuid4()), 1, 2.5)  # another shipment's deadline, due meanwhile
    stop = threading.Event()
    sock = _connect(receiver)

    def flood() -> None:  # PINGs whose PONGs it never reads: the receiver's replies fill the socket
        with contextlib.suppress(OSError):
            while not stop.is_set():
                sock.sendall(encode(Frame(FrameType.PING, payload=b"x" * 60000)))

    try:
        assert _open(sock, job, [(1, 8, 64)], 4096).type is FrameType.OPEN_OK
        threading.Thread(target=flood, daemon=True).start()
        time.sleep(1.0)  # the connection's thread now waits in a send of a PONG
        start = time.monotonic()
        inbound.cancel("the decode engine gave up")
        assert time.monotonic() - start < 0.5
        assert other.wait(3) is TransferStatus.TIMEOUT and time.monotonic() - start < 2.5  # reaped on time
    finally:
        stop.set()
        start = time.monotonic()
        receiver.close()
        assert time.monotonic() - start < 3
        sock.close()


def test_an_open_or_cancel_whose_payload_fails_its_checksum_is_refused_not_acted_on() -> None:
    """An OPEN corrupted on the way (one digit of a shape: "64" read as "94") would be over its ticket's
    budget and end the shipment for good; a corrupted CANCEL would still cancel. Either closes its
    connection with BAD_FRAME instead, and the shipment waits for the frame sent again on a new one."""
    receiver = TcpReceiver(VERIFIER)
    job = str(uuid.uuid4())
    shape = (1, 64, 64)
    body = {"ticket": SIGNER.issue(job, 1, "acme", 2 * 64 * 64 * 2, ttl_s=60), "num_layers": 1, "dtype": "bfloat16",
            "layer_shapes": [list(shape)], "codec": 0, "chunk_bytes": 4096}  # fmt: skip
    whole = encode(Frame(FrameType.OPEN, job_bytes(job), 1, payload=json_payload(body)))
    opening = bytearray(whole)
    cancel = bytearray(encode(Frame(FrameType.CANCEL, job_bytes(job), 1, payload=b"canceled by the sender")))
    try:
        inbound = receiver.expect(job, 1, 30)
        for wire, corrupt_at in ((opening, opening.index(b"[[1,64,64]]") + 4), (cancel, len(cancel) - 1)):
            wire[corrupt_at] = ord("9")  # the shape's "64" reads "94"; the reason's last letter
            sock = _connect(receiver)
            if wire is cancel:
                sock.sendall(whole)
                assert read_frame(sock)[0].type is FrameType.OPEN_OK
            sock.sendall(bytes(wire))
            reply = read_frame(sock)[0]
            assert reply.type is FrameType.ERROR and reply.json()["code"] == "BAD_FRAME", bytes(reply.payload)
            with contextlib.suppress(ConnectionResetError):
                assert sock.recv(1) == b""  # closed
            sock.close()
            assert not inbound.status().terminal
        sock = _connect(receiver)  # the OPEN sent again, whole
        sock.sendall(whole)
        assert read_frame(sock)[0].type is FrameType.OPEN_OK
        sock.close()
    finally:
        receiver.close()
