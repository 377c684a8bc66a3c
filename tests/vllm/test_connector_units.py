"""The KV connector's bookkeeping, on a real `PrfaasConnector` made from a real `VllmConfig` (no engine
started): what a failed load reports, what the worker keeps of finished requests, shipment outcomes by
attempt."""

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
from prfaas.engine.vllm.params import LoadParams
from prfaas.transport.api import TransferStatus
from prfaas.transport.tcp_receiver import TcpReceiver
from prfaas.transport.tickets import TicketVerifier

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
