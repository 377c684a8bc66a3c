"""How a prefill job ends when it ends early, on a region in this process (tiny-llama, real gRPC servers and
KV sockets on loopback): its shipment is counted in the region's metrics, a caller gone before its cancel
callback was registered frees its queue slot, and a region stopping under a Prefill refuses it UNAVAILABLE."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from prometheus_client import REGISTRY
from region_kit import cancel, local_region, new_job, prefill_request, reserve, split_generate, wait_until

from prfaas.engine.hf import HFEngine
from prfaas.engine.sampling import SamplingParams
from prfaas.prefill_region.hf_backend import HFPrefill

GREEDY = SamplingParams(max_new_tokens=4, ignore_eos=True)


@pytest.fixture
def silent_kv_port() -> Iterator[str]:
    """A KV endpoint that accepts connections and never answers."""
    hole = socket.create_server(("127.0.0.1", 0), backlog=64)
    held: list[socket.socket] = []
    threading.Thread(target=lambda: [held.append(hole.accept()[0]) for _ in range(64)], daemon=True).start()
    yield f"127.0.0.1:{hole.getsockname()[1]}"
    hole.close()


def _shipments(status: str) -> float:
    return REGISTRY.get_sample_value("prfaas_region_shipments_total", {"kind": "prefill", "status": status}) or 0.0


def _wire_bytes() -> float:
    return REGISTRY.get_sample_value("prfaas_region_shipped_wire_bytes_total") or 0.0


def test_a_shipment_canceled_mid_prefill_is_counted_once(tiny_engine: HFEngine) -> None:
    """A Cancel after the first layer left (each layer stretched to 0.5 s): the shipment, canceled, is counted
    in prfaas_region_shipments_total with its wire bytes (before, only a shipment whose forward ended was: one
    canceled, refused or failed mid-forward was not counted, though its bytes went on the wire); a completed
    one is counted once."""
    region = local_region(tiny_engine)
    try:
        assert region.prefill is not None and isinstance(region.prefill.backend, HFPrefill)
        ids = list(range(5, 305))
        kv_bytes = len(ids) * tiny_engine.kv_bytes_per_token
        completed = _shipments("completed")
        split_generate(region.prefill_stub, region.decode_stub, ids, GREEDY, kv_bytes)
        assert _shipments("completed") == completed + 1

        region.prefill.backend.test_layer_delay_s = 0.5
        canceled, wire = _shipments("canceled"), _wire_bytes()
        job_id = new_job()
        reply = reserve(region.decode_stub, job_id, kv_bytes)
        stream = region.prefill_stub.Prefill(prefill_request(job_id, ids, GREEDY, reply.kv_endpoint,
                                                             budget=kv_bytes), timeout=30)  # fmt: skip
        assert next(event for event in stream if event.HasField("layer_shipped")).layer_shipped.layer == 0
        assert cancel(region.prefill_stub, job_id)
        wait_until(lambda: region.prefill is not None and region.prefill.idle(), timeout_s=5)
        assert _shipments("canceled") == canceled + 1
        assert _wire_bytes() > wire  # the first layer went out
        assert _shipments("completed") == completed + 1
    finally:
        region.close()


def test_a_caller_gone_before_its_cancel_callback_frees_its_queue_slot(
    tiny_engine: HFEngine, silent_kv_port: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One worker held by a shipment no one reads; a second Prefill's caller leaves before the agent registers
    its cancel callback (the window held open until gRPC has ended the call): the queued job ends at once
    (before, add_callback's False was ignored, and the job kept its queue slot until the worker freed)."""
    region = local_region(tiny_engine, decode=False, workers=1, queue_depth=4)
    try:
        agent = region.prefill
        assert agent is not None
        ids = tiny_engine.encode("the worker is busy shipping to a port that never answers")
        busy = region.prefill_stub.Prefill(prefill_request(new_job(), ids, GREEDY, silent_kv_port, timeout_s=30),
                                           timeout=40)  # fmt: skip
        next(busy)  # started: the worker is taken
        prefill, entered, ended = agent._prefill, threading.Event(), threading.Event()

        def late(*args: Any) -> Iterator[Any]:
            context = args[2]
            entered.set()
            wait_until(lambda: not context.is_active(), timeout_s=5)  # the caller is gone, the call over
            try:
                yield from prefill(*args)
            finally:
                ended.set()

        monkeypatch.setattr(agent, "_prefill", late)
        left = region.prefill_stub.Prefill(prefill_request(new_job(), ids, GREEDY, silent_kv_port, timeout_s=30),
                                           timeout=40)  # fmt: skip
        assert entered.wait(5)
        left.cancel()
        assert ended.wait(3)  # (before: ~30 s, at the busy job's end)
        assert agent.load()["queue_depth"] == 0
        busy.cancel()
    finally:
        region.close()


def test_a_region_stopping_while_it_admits_a_prefill_refuses_it_unavailable(
    tiny_engine: HFEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The region stops between a Prefill's admission and its hand-over to a worker (close() run from inside
    that window): the call ends UNAVAILABLE and the job leaves the agent's table (before, the closed worker
    pool's RuntimeError escaped: INTERNAL, and the job stayed)."""
    region = local_region(tiny_engine)
    try:
        agent = region.prefill
        assert agent is not None
        gauges, fired = agent._gauges, []

        def stop_now() -> None:
            if not fired and agent._jobs:  # admitted, not yet handed to a worker
                fired.append(True)
                agent.close()
            gauges()

        monkeypatch.setattr(agent, "_gauges", stop_now)
        ids = list(range(5, 69))
        kv_bytes = len(ids) * tiny_engine.kv_bytes_per_token
        job_id = new_job()
        reply = reserve(region.decode_stub, job_id, kv_bytes)
        with pytest.raises(grpc.RpcError) as info:
            list(region.prefill_stub.Prefill(prefill_request(job_id, ids, GREEDY, reply.kv_endpoint,
                                                             budget=kv_bytes), timeout=20))  # fmt: skip
        assert fired and info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert job_id not in agent._jobs
    finally:
        region.close()
