"""`KVLink`, the KV port and channels a vLLM engine's connector and host share (engine/vllm/link.py), on a
real TCP receiver (no vLLM needed)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import pytest

from prfaas.engine.vllm.link import KVLink
from prfaas.transport.api import TransferStatus
from prfaas.transport.errors import TransportError
from prfaas.transport.tickets import TicketVerifier


@pytest.fixture
def link() -> Iterator[KVLink]:
    kv = KVLink("decode", TicketVerifier({"k1": b"k" * 32}), "127.0.0.1", 0)
    yield kv
    kv.close()


def test_a_load_of_a_registration_whose_shipment_already_failed_fails_at_once(link: KVLink) -> None:
    """The reservation's shipment failed (here: its deadline passed) before the Decode's request took it: the
    load gets that failed shipment and gives up at once, instead of registering anew and waiting its own
    whole deadline for KV the receiver already refused."""
    job = str(uuid.uuid4())
    reserved = link.expect(job, 1, 0.3)
    assert reserved.wait(5) is TransferStatus.TIMEOUT
    assert link.attach(job, 1, 30) is reserved  # the Decode's request, as the host submits it: the failed one
    started = time.monotonic()
    with pytest.raises(TransportError):
        link.take(job, 1, 30).layer(0, timeout_s=10)
    assert time.monotonic() - started < 1
    assert link.forget(job, 2) is False
    assert link.expect(job, 1, 30) is not reserved  # the attempt reserved anew: a new registration


def test_a_registration_nobody_took_is_forgotten_once(link: KVLink) -> None:
    job = str(uuid.uuid4())
    link.expect(job, 1, 30)
    assert link.forget(job, 1) is True
    assert link.forget(job, 1) is False
