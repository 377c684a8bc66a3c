"""The sender's resources over many transfers (real TCP and shared-memory channels; a raw-frame receiver
that answers one chunk with NACK and then ACK): no in-flight budget or memory outlives a transfer.

Before: a chunk ACKed while its NACKed copy waited in the queue was sent and charged again, its budget never
released, and once the leak reached the channel's budget every later transfer timed out; a failed transfer's
chunks stayed queued (TCP, no connection to pop them) or parked (shared memory, encoded after the end) with
its producer's buffers for the channel's life; a codec error in an encoder thread was lost and the transfer
waited for its deadline; a layer given after the channel closed raised RuntimeError."""

from __future__ import annotations

import gc
import json
import socket
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
from transport_kit import Kit, fill, layers_for

from prfaas.devstack.processes import free_port
from prfaas.transport import outbound
from prfaas.transport.api import Shipment, TransferStatus
from prfaas.transport.framing import Frame, FrameType, ack_payload, encode, json_payload, read_frame
from prfaas.transport.shm_receiver import ShmReceiver
from prfaas.transport.shm_sender import ShmChannel
from prfaas.transport.tcp_sender import TcpChannel


class NackThenAck:
    """A receiver on a real socket: OPEN_OK, ACK for each chunk and DONE once all came, except that the first
    chunk of each shipment is first NACKed (a bad checksum, it thinks) and then ACKed (it was stored after all)."""

    def __init__(self) -> None:
        self.server = socket.create_server(("127.0.0.1", 0), backlog=16)
        self.address = self.server.getsockname()
        self.lock = threading.Lock()
        self.jobs: dict[tuple[bytes, int], dict[str, Any]] = {}
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        send_lock = threading.Lock()

        def send(frame: Frame) -> None:
            with send_lock:
                conn.sendall(encode(frame))

        try:
            while True:
                frame, _ok = read_frame(conn)
                key = (bytes(frame.job_id), frame.attempt)
                if frame.type is FrameType.HELLO:
                    send(Frame(FrameType.HELLO_OK, payload=json_payload({"version": 1, "node": "rx"})))
                elif frame.type is FrameType.OPEN:
                    with self.lock:
                        layers = json.loads(bytes(frame.payload))["num_layers"]
                        self.jobs.setdefault(key, {"parts": 2 * layers, "got": set(), "nacked": False})
                    send(Frame(FrameType.OPEN_OK, frame.job_id, frame.attempt))
                elif frame.type is FrameType.DATA:
                    with self.lock:
                        job = self.jobs[key]
                        nack, job["nacked"] = not job["nacked"], True
                        job["got"].add(frame.key)
                        done = len(job["got"]) == job["parts"]  # one chunk per part here
                    if nack:
                        send(
                            Frame(FrameType.NACK, frame.job_id, frame.attempt, frame.layer, frame.part, 0, frame.chunk)
                        )
                    send(Frame(FrameType.ACK, frame.job_id, frame.attempt, payload=ack_payload([frame.key])))
                    if done:
                        send(Frame(FrameType.DONE, frame.job_id, frame.attempt))
                elif frame.type is FrameType.PING:
                    send(Frame(FrameType.PONG, payload=frame.payload))
        except (OSError, ConnectionError, ValueError):
            conn.close()

    def close(self) -> None:
        self.server.close()


@pytest.fixture
def receiver() -> Iterator[NackThenAck]:
    rx = NackThenAck()
    yield rx
    rx.close()


def test_a_chunk_acked_while_its_copy_waits_leaks_no_budget(kit: Kit, receiver: NackThenAck) -> None:
    chunk = 64 << 10
    with TcpChannel(receiver.address, num_streams=2, max_inflight_bytes=4 * (chunk + 64)) as channel:
        for _ in range(8):
            spec = kit.spec(num_layers=2, shape=(2, 256, 64), chunk_bytes=chunk, timeout_s=5)  # a chunk a part
            shipment = Shipment(spec)
            transfer = channel.submit(shipment)
            fill(shipment, layers_for(spec))
            assert transfer.wait(10) is TransferStatus.COMPLETED, transfer.error
            deadline = time.monotonic() + 2
            while channel.queue.inflight_bytes and time.monotonic() < deadline:
                time.sleep(0.01)
            assert channel.queue.inflight_bytes == 0


def _ended_and_freed(channel: TcpChannel | ShmChannel, kit: Kit, spec_args: dict[str, Any], end: Any) -> int:
    """Run 4 transfers that fail; how many of them are still referenced afterwards (a loop variable of the
    channel's own threads may hold the last one until its next turn: 1 at most is no leak)."""
    refs = []
    for seed in range(4):
        spec = kit.spec(**({"num_layers": 4, "shape": (8, 1024, 128), "codec": "lossless"} | spec_args))
        layers = layers_for(spec, seed=seed)  # made first: the layers come right after the submit
        shipment = Shipment(spec)
        transfer = channel.submit(shipment)
        fill(shipment, layers)
        end(transfer)
        assert transfer.wait(10).terminal
        refs.append(weakref.ref(transfer))
        del transfer, shipment
    time.sleep(1.0)  # the encoders finish the layers they had
    gc.collect()
    return sum(ref() is not None for ref in refs)


def test_failed_transfers_leave_nothing_queued_without_a_connection(kit: Kit) -> None:
    with TcpChannel(("127.0.0.1", free_port()), num_streams=2, unavailable_after_s=0.3) as channel:  # refused
        assert _ended_and_freed(channel, kit, {"timeout_s": 30}, lambda t: None) <= 1
        assert channel.queue._heap == []


def test_transfers_ended_before_open_ok_leave_nothing_parked(kit: Kit) -> None:
    rx = ShmReceiver(kit.verifier, arena_bytes=64 << 20)
    try:
        with ShmChannel(rx.path) as channel:
            # refused at OPEN while its layers are encoded: their chunks come out after the end
            refused = {"shape": (8, 4096, 128), "ticket": "forged"}
            assert _ended_and_freed(channel, kit, refused, lambda transfer: None) <= 1
            assert channel._waiting == {}
    finally:
        rx.close()


def test_an_encoder_error_fails_the_transfer_at_once(kit: Kit, receiver: NackThenAck, monkeypatch: Any) -> None:
    def broken(*_: Any, **__: Any) -> bytes:
        raise struct_error("'I' format requires 0 <= number <= 4294967295")

    struct_error = type("error", (Exception,), {})
    monkeypatch.setattr(outbound, "encode_header", broken)
    with TcpChannel(receiver.address, num_streams=1) as channel:
        spec = kit.spec(num_layers=1, shape=(2, 256, 64), timeout_s=30)
        shipment = Shipment(spec)
        transfer = channel.submit(shipment)
        started = time.monotonic()
        fill(shipment, layers_for(spec))
        assert transfer.wait(10) is TransferStatus.FAILED and time.monotonic() - started < 5
        assert "encoding layer 0 failed" in str(transfer.error)


def test_a_layer_given_after_the_channel_closed_is_dropped(kit: Kit, receiver: NackThenAck) -> None:
    channel = TcpChannel(receiver.address, num_streams=1)
    spec = kit.spec(num_layers=2, shape=(2, 256, 64), codec="lossless", timeout_s=30)
    shipment = Shipment(spec)
    transfer = channel.submit(shipment)
    channel.close()
    assert transfer.wait(5) is TransferStatus.CANCELED
    fill(shipment, layers_for(spec))  # the producer had not heard: no RuntimeError from a closed encoder pool
