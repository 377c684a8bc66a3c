"""The KV connector's bookkeeping, on a real `PrfaasConnector` made from a real `VllmConfig` (no engine
started): what a failed load reports, what the worker keeps of finished requests, shipment outcomes by
attempt, a shipment canceled when its job ends."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest
import torch

from prfaas.engine.vllm.layout import load_blocks
from prfaas.engine.vllm.link import ShipOutcome
from prfaas.engine.vllm.params import LoadParams, ShipParams
from prfaas.transport.api import TransferStatus
from prfaas.transport.tcp_receiver import TcpReceiver
from prfaas.transport.tickets import TicketSigner, TicketVerifier

if TYPE_CHECKING:
    from prfaas.engine.vllm.connector import PrfaasConnector

pytestmark = pytest.mark.vllm  # vLLM itself is imported in the tests: the main suite collects this module too
BLOCK = 16


@pytest.fixture
def worker() -> Iterator[PrfaasConnector]:
    from vllm.config import CacheConfig, KVTransferConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from prfaas.engine.vllm.connector import PrfaasConnector

    transfer = KVTransferConfig(
        kv_connector="PrfaasConnector", kv_connector_module_path="prfaas.engine.vllm.connector",
        kv_role="kv_both", engine_id=f"units-{uuid.uuid4().hex[:8]}", kv_connector_extra_config={},
    )  # fmt: skip
    config = VllmConfig(kv_transfer_config=transfer, cache_config=CacheConfig(block_size=BLOCK))
    connector = PrfaasConnector(config, KVConnectorRole.WORKER, None)  # type: ignore[arg-type]
    yield connector
    connector.shutdown()


def test_a_failed_load_names_only_the_blocks_it_was_to_write(worker: PrfaasConnector) -> None:
    """60 prompt tokens, the first 32 (blocks 10, 11) a local prefix-cache hit shared with other requests:
    a load that fails names blocks 12 and 13 only, or vLLM recomputes every running request on 10 and 11."""
    from prfaas.engine.vllm.jobs import LoadJob

    job = LoadJob("req", LoadParams(str(uuid.uuid4()), 1, 0.2, 60), (10, 11, 12, 13, 14), 32, 60)
    assert load_blocks(job.block_ids, job.start_token, job.num_tokens, BLOCK) == (12, 13)
    worker._caches = {0: torch.zeros(32, 2, BLOCK, 16)}
    worker._load(job)  # nothing ships it: it fails at its 0.2 s deadline
    assert worker.get_block_ids_with_load_errors() == {12, 13}
    assert worker.get_transfer_results(set()).finished_recving == {"req"}


def test_the_worker_keeps_no_finished_request_it_does_not_ship(worker: PrfaasConnector) -> None:
    for step in range(2000):  # vLLM names every finished request to every worker, each step
        worker.get_transfer_results({f"plain-{step}"})
    assert worker._finished_reqs == set()
    worker._ship_reqs.add("shipped")  # a ship job whose transfer failed before it opened
    worker._send_failed.add("shipped")
    assert worker.get_transfer_results({"shipped"}).finished_sending == {"shipped"}
    assert worker._finished_reqs == set() and worker._ship_reqs == set()


def test_a_shipment_outcome_is_given_to_its_own_attempt_only(worker: PrfaasConnector) -> None:
    link = worker._link
    assert link is not None
    job = str(uuid.uuid4())
    failed = ShipOutcome(TransferStatus.FAILED, 0, 0, 0.0, "reservation ended", "TransferCanceled")
    link.record_shipped(job, 1, failed)  # attempt 1's, left unread: its prefill stopped waiting
    assert link.wait_shipped(job, 2, 0.1) is None  # attempt 2's shipment has not ended
    done = ShipOutcome(TransferStatus.COMPLETED, 10, 10, 0.1, None, None)
    threading.Timer(0.05, link.record_shipped, (job, 2, done)).start()
    assert link.wait_shipped(job, 2, 5) == done


def test_a_load_whose_request_vllm_aborted_stops_waiting_and_asks_no_recompute(worker: PrfaasConnector) -> None:
    """vLLM names an aborted request among the finished ones: its load (waiting up to 60 s for a shipment
    that will not come) is canceled at once, reports its end (vLLM then frees the blocks) and names no
    block to recompute."""
    link = worker._link
    assert link is not None
    link.receiver = TcpReceiver(TicketVerifier({"k1": b"k" * 32}))  # the engine's KV port
    try:
        from prfaas.engine.vllm.jobs import LoadJob

        job = LoadJob("aborted", LoadParams(str(uuid.uuid4()), 1, 60.0, 32), (3, 4), 0, 32)
        worker._caches = {0: torch.zeros(8, 2, BLOCK, 16)}
        worker._loading[job.req_id] = None  # as start_load_kv registers it before the loader's thread starts
        loader = threading.Thread(target=worker._load, args=(job,))
        loader.start()
        time.sleep(0.2)
        started = time.monotonic()
        worker.get_transfer_results({"aborted"})
        loader.join(5)
        assert not loader.is_alive() and time.monotonic() - started < 2
        assert worker.get_block_ids_with_load_errors() == set()
        assert worker.get_transfer_results(set()).finished_recving == {"aborted"}
        assert worker._loading == {} and worker._dropped_loads == set()
    finally:
        link.receiver.close()


def test_a_shipment_canceled_on_the_wire_ends_canceled_and_the_receiver_sees_it(worker: PrfaasConnector) -> None:
    """A prefill job that ends while its shipment is still going (vLLM's request finished, the receiver slow)
    cancels it through the link (`cancel_shipment`, what the server's call reaches): the transfer ends CANCELED
    at once instead of at its 60 s deadline, the receiver gets the CANCEL, the connector frees the blocks and
    records the outcome. Again: harmless. A shipment canceled before its transfer opens is canceled as it opens."""
    from prfaas.engine.staging import feed_layer
    from prfaas.engine.vllm.jobs import ShipJob
    from prfaas.engine.vllm.layout import gather_layer

    link = worker._link
    assert link is not None
    key = b"k" * 32
    link.receiver = TcpReceiver(TicketVerifier({"k1": key}))  # the decode region's KV port
    try:
        host, port = link.receiver.address
        worker._caches = {0: torch.zeros(8, 2, BLOCK, 16), 1: torch.zeros(8, 2, BLOCK, 16)}  # 2 layers

        def ship_job(job_id: str, req_id: str) -> ShipJob:
            ticket = TicketSigner({"k1": key}, "k1").issue(job_id, 1, "tenant-a", 1 << 30, ttl_s=60)
            return ShipJob(req_id, ShipParams(job_id, 1, ticket, f"{host}:{port}", "lossless", 60.0), (3, 4), 32)

        job = ship_job(str(uuid.uuid4()), "req")
        inbound = link.expect(job.params.job_id, 1, 60.0)
        worker._ship_reqs.add("req")  # as start_load_kv records it
        out = worker._open_shipment(job, worker._caches[0])
        assert out is not None
        k, v = gather_layer(worker._caches[0], job.block_ids, job.num_tokens)
        feed_layer(out.shipment, None, 0, k, v)  # layer 1 is still to come: the transfer stays in flight
        inbound.layer(0, timeout_s=10)  # on the wire: the receiver has layer 0
        assert out.transfer.status() is TransferStatus.IN_FLIGHT

        started = time.monotonic()
        assert link.cancel_shipment(job.params.job_id, 1) is True
        assert out.transfer.wait(2) is TransferStatus.CANCELED
        assert inbound.wait(5) is TransferStatus.CANCELED  # the CANCEL reached the receiver
        assert time.monotonic() - started < 5
        assert link.cancel_shipment(job.params.job_id, 1) is False  # it ended: nothing left to cancel
        assert worker.get_transfer_results({"req"}).finished_sending == {"req"}  # vLLM frees the blocks
        outcome = link.wait_shipped(job.params.job_id, 1, 1)
        assert outcome is not None and outcome.status is TransferStatus.CANCELED

        early = ship_job(str(uuid.uuid4()), "early")  # its job ended while vLLM still computed it
        assert link.cancel_shipment(early.params.job_id, 1) is False
        opened = worker._open_shipment(early, worker._caches[0])
        assert opened is not None and opened.transfer.status() is TransferStatus.CANCELED
    finally:
        link.receiver.close()
