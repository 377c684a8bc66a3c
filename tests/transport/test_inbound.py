"""Receiver-side assembly: chunks read straight into a part's buffer, claimed until verified."""

import os
import threading
import time
import uuid

import pytest

from prfaas.transport.api import TransferStatus
from prfaas.transport.codecs import CodecId
from prfaas.transport.errors import FrameError, TicketRejected
from prfaas.transport.inbound import Inbound, Slot
from prfaas.transport.open_info import OpenInfo
from prfaas.transport.tickets import Ticket

SHAPE = (2, 64, 64)  # 16 KiB per bf16 part
PART = 2 * 64 * 64 * 2
CHUNK = 4096  # 4 chunks per part


def open_inbound() -> Inbound:
    job = str(uuid.uuid4())
    inbound = Inbound(job, 1, timeout_s=10)
    ticket = Ticket(job, 1, "acme", 1 << 30, time.time() + 60, "n", "k")
    inbound.open(OpenInfo("bfloat16", (SHAPE,), int(CodecId.RAW), CHUNK), ticket)
    return inbound


def test_raw_chunks_land_in_place_and_the_layer_is_the_buffer() -> None:
    inbound = open_inbound()
    k, v = os.urandom(PART), os.urandom(PART)
    for part, data in enumerate((k, v)):
        for chunk in reversed(range(4)):  # any order
            assert (
                inbound.accept(0, part, chunk, 4, int(CodecId.RAW), PART, data[chunk * CHUNK : (chunk + 1) * CHUNK])
                is None
            )
    assert inbound.wait(1) is TransferStatus.COMPLETED
    assert inbound.layer(0, 1) == (k, v)
    assert inbound.wire_bytes == 2 * PART


def test_a_claimed_chunk_is_pending_for_other_connections_until_verified() -> None:
    inbound = open_inbound()
    view = inbound.slot(0, 0, 1, 4, int(CodecId.RAW), PART, CHUNK)
    assert isinstance(view, memoryview) and len(view) == CHUNK
    assert inbound.slot(0, 0, 1, 4, int(CodecId.RAW), PART, CHUNK) is Slot.PENDING  # no ACK for the twin
    inbound.commit(0, 0, 1, CHUNK, ok=False)  # bad checksum: the claim is dropped, the sender resends
    view = inbound.slot(0, 0, 1, 4, int(CodecId.RAW), PART, CHUNK)
    assert isinstance(view, memoryview)
    view[:] = bytes(CHUNK)
    inbound.commit(0, 0, 1, CHUNK, ok=True)
    assert inbound.slot(0, 0, 1, 4, int(CodecId.RAW), PART, CHUNK) is Slot.DUPLICATE  # ACK it again


def _accept_in_thread(inbound: Inbound, data: bytes) -> tuple[threading.Thread, list[Slot | None]]:
    inbound.pending_wait_s = 30.0  # the first copy's commit, not the timeout, must end the wait
    got: list[Slot | None] = []
    thread = threading.Thread(
        target=lambda: got.append(inbound.accept(0, 0, 1, 4, int(CodecId.RAW), PART, data)), daemon=True
    )
    thread.start()
    return thread, got


def test_a_resent_copy_is_stored_when_the_connection_reading_the_first_one_dies() -> None:
    # The sender's stream broke while the receiver read chunk 1 on it; the sender resent the
    # chunk on another stream before the receiver saw the break. That copy must be stored
    # and acknowledged once the first claim drops: nobody else will answer for the chunk.
    inbound = open_inbound()
    first = inbound.slot(0, 0, 1, 4, int(CodecId.RAW), PART, CHUNK)
    assert isinstance(first, memoryview)
    data = os.urandom(CHUNK)
    thread, got = _accept_in_thread(inbound, data)
    time.sleep(0.1)
    assert thread.is_alive()  # waiting for the first copy
    inbound.commit(0, 0, 1, CHUNK, ok=False)  # its connection died mid-chunk
    thread.join(10)
    assert got == [None]  # stored: the receiver ACKs it
    assert inbound.slot(0, 0, 1, 4, int(CodecId.RAW), PART, CHUNK) is Slot.DUPLICATE


def test_a_resent_copy_is_a_duplicate_once_the_first_copy_is_stored() -> None:
    inbound = open_inbound()
    first = inbound.slot(0, 0, 1, 4, int(CodecId.RAW), PART, CHUNK)
    assert isinstance(first, memoryview)
    thread, got = _accept_in_thread(inbound, os.urandom(CHUNK))
    time.sleep(0.1)
    first[:] = bytes(CHUNK)
    inbound.commit(0, 0, 1, CHUNK, ok=True)
    thread.join(10)
    assert got == [Slot.DUPLICATE]


def test_a_resent_copy_stays_pending_while_the_first_is_still_read() -> None:
    inbound = open_inbound()
    inbound.pending_wait_s = 0.05
    assert isinstance(inbound.slot(0, 0, 1, 4, int(CodecId.RAW), PART, CHUNK), memoryview)
    started = time.monotonic()
    assert inbound.accept(0, 0, 1, 4, int(CodecId.RAW), PART, os.urandom(CHUNK)) is Slot.PENDING  # receiver NACKs
    assert 0.04 <= time.monotonic() - started < 1.0


@pytest.mark.parametrize(
    ("chunk", "count", "payload_len", "message"),
    [
        (0, 4, CHUNK - 1, "payload bytes"),  # a middle chunk shorter than chunk_bytes
        (3, 4, CHUNK + 1, "payload bytes"),  # a last chunk past the tensor's end
        (0, 5, CHUNK, "does not fit"),  # raw chunking is fixed by the shape
    ],
)
def test_chunks_that_do_not_fit_the_open_are_refused(chunk: int, count: int, payload_len: int, message: str) -> None:
    inbound = open_inbound()
    with pytest.raises(FrameError, match=message):
        inbound.slot(0, 0, chunk, count, int(CodecId.RAW), PART, payload_len)


def test_an_ended_shipment_takes_no_more_chunks() -> None:
    inbound = open_inbound()
    inbound.cancel("test")
    assert inbound.slot(0, 0, 0, 4, int(CodecId.RAW), PART, CHUNK) is Slot.ENDED


def test_released_raw_layers_are_reused_and_the_pool_is_bounded() -> None:
    from prfaas.transport.buffers import POOL, BufferPool

    pool = BufferPool(max_bytes=3 * CHUNK)
    a, b = pool.get(CHUNK), pool.get(CHUNK)
    pool.put(a)
    pool.put(b)
    pool.put(bytearray(2 * CHUNK))  # over the bound: dropped
    assert pool.pooled_bytes == 2 * CHUNK
    assert pool.get(CHUNK) is b and pool.get(CHUNK) is a
    fresh = pool.get(CHUNK)
    assert fresh is not a and fresh is not b

    inbound = open_inbound()
    k, v = os.urandom(PART), os.urandom(PART)
    for part, data in enumerate((k, v)):
        for chunk in range(4):
            inbound.accept(0, part, chunk, 4, int(CodecId.RAW), PART, data[chunk * CHUNK : (chunk + 1) * CHUNK])
    got_k, _got_v = inbound.layer(0, 1)
    inbound.release()
    again = open_inbound()
    view = again.slot(0, 0, 0, 4, int(CodecId.RAW), PART, CHUNK)
    assert isinstance(view, memoryview) and any(view.obj is buf for buf in (got_k, _got_v))  # reused
    assert POOL.pooled_bytes <= POOL.max_bytes


def _ticket(job: str, tenant: str = "acme", budget: int = 1 << 30) -> Ticket:
    return Ticket(job, 1, tenant, budget, time.time() + 60, "n", "k")


@pytest.mark.parametrize(
    ("tenant", "max_bytes", "message"),
    [
        ("globex", None, "ticket is for tenant 'globex', the reservation for 'acme'"),
        ("acme", 2 * PART - 1, "exceeds the reservation's budget of 32767"),  # one layer is 2 * PART raw bytes
    ],
)
def test_an_open_past_the_reservation_is_refused_and_ends_the_shipment(
    tenant: str, max_bytes: int | None, message: str
) -> None:
    job = str(uuid.uuid4())
    inbound = Inbound(job, 1, timeout_s=10, tenant="acme", max_bytes=max_bytes)
    with pytest.raises(TicketRejected, match=message):
        inbound.open(OpenInfo("bfloat16", (SHAPE,), int(CodecId.RAW), CHUNK), _ticket(job, tenant))
    assert inbound.status() is TransferStatus.FAILED and isinstance(inbound.error, TicketRejected)
    assert inbound.info is None and inbound.stored_bytes == 0


def test_a_ticket_granting_more_than_the_reservation_is_refused_even_when_the_kv_fits() -> None:
    """The control plane signs a ticket for exactly the bytes it reserved: a ticket for more
    is not this reservation's, whatever the OPEN declares."""
    job = str(uuid.uuid4())
    info = OpenInfo("bfloat16", (SHAPE,), int(CodecId.RAW), CHUNK)  # 2 * PART raw bytes
    inbound = Inbound(job, 1, timeout_s=10, tenant="acme", max_bytes=2 * PART)
    with pytest.raises(TicketRejected, match=f"ticket budget {2 * PART + 1} exceeds the reservation's budget"):
        inbound.open(info, _ticket(job, budget=2 * PART + 1))
    assert inbound.status() is TransferStatus.FAILED and inbound.stored_bytes == 0
    exact = Inbound(job, 2, timeout_s=10, tenant="acme", max_bytes=2 * PART)
    assert exact.open(info, _ticket(job, budget=2 * PART))


def test_an_encoded_shipment_takes_no_more_part_memory_than_its_budget() -> None:
    """Encoded parts are sized by the chunk count their DATA headers claim (at most 2x raw + 64 KiB
    each): whatever they claim, the parts of one shipment take at most its budget plus one
    chunk (and 4 KiB) per part; an honest incompressible shipment fits."""
    job = str(uuid.uuid4())
    raw = 4 * 2 * PART
    inbound = Inbound(job, 1, timeout_s=10, max_bytes=raw)
    info = OpenInfo("bfloat16", (SHAPE,) * 4, int(CodecId.LOSSLESS), CHUNK)
    inbound.open(info, _ticket(job, budget=raw))
    assert inbound.allowance(info, _ticket(job, budget=raw)) == raw + 8 * (min(CHUNK, 65536) + 4096)
    claimed = -(-(2 * PART + 65536) // CHUNK)  # the most chunks a part may claim: 24 (96 KiB)
    assert isinstance(inbound.slot(0, 0, 0, claimed, int(CodecId.LOSSLESS), PART, CHUNK), memoryview)
    assert isinstance(inbound.slot(0, 1, 0, claimed, int(CodecId.LOSSLESS), PART, CHUNK), memoryview)
    with pytest.raises(TicketRejected, match="past its budget"):
        inbound.slot(1, 0, 0, claimed, int(CodecId.LOSSLESS), PART, CHUNK)
    assert inbound.stored_bytes == 2 * claimed * CHUNK

    honest = Inbound(job, 2, timeout_s=10, max_bytes=raw)
    honest.open(info, Ticket(job, 2, "acme", raw, time.time() + 60, "m", "k"))
    count = -(-(PART + 56) // CHUNK)  # lossless of random bytes: raw + 56 bytes
    for layer in range(4):
        for part in (0, 1):
            assert isinstance(honest.slot(layer, part, 0, count, int(CodecId.LOSSLESS), PART, CHUNK), memoryview)
