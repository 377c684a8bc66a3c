"""Dispatch does not hold a worker thread for a prefill (issue 22): 500 split jobs in flight at
once through ONE Celery worker process of concurrency 2 (a real worker, real Redis), against a
prefill region that stalls every prefill 8 s. The regions are test servers (real gRPC, asyncio)
registered in the fleet like real ones: the prefill counts its streams in flight, the decode
hands out three tokens a job."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from cp_kit import ensure_redis, stack_settings
from fake_regions import FakeRegions

from prfaas.control_plane.jobs.celery_app import enqueue, make_celery
from prfaas.control_plane.jobs.generation import Follower
from prfaas.control_plane.services import Services
from prfaas.control_plane.tenants import Quota
from prfaas.devstack.stack import Stack, wait_until
from prfaas.engine.models import prepare_model
from prfaas.protos.prfaas.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc

pytestmark = pytest.mark.e2e
JOBS = 500
STALL_S = 8.0
TOKENS = [11, 12, 13]


class StallingPrefill(prefill_pb2_grpc.PrefillRegionServicer):
    def __init__(self) -> None:
        self.in_flight = 0
        self.peak = 0
        self.started = 0

    async def Prefill(self, request: prefill_pb2.PrefillRequest, context: Any) -> AsyncIterator[Any]:  # noqa: N802
        self.in_flight += 1
        self.started += 1
        self.peak = max(self.peak, self.in_flight)
        try:
            yield prefill_pb2.PrefillEvent(started=prefill_pb2.Started())
            await asyncio.sleep(STALL_S)
            kv = common_pb2.KVDescriptor(num_tokens=len(request.token_ids), dtype="float32")
            done = prefill_pb2.PrefillDone(first_token=TOKENS[0], kv=kv, prefill_s=STALL_S)
            yield prefill_pb2.PrefillEvent(prefill_done=done)
            yield prefill_pb2.PrefillEvent(shipment_complete=prefill_pb2.ShipmentComplete(raw_bytes=1, wire_bytes=1))
        finally:
            self.in_flight -= 1

    async def Cancel(self, request: common_pb2.CancelRequest, context: Any) -> common_pb2.CancelReply:  # noqa: N802
        return common_pb2.CancelReply()


class InstantDecode(decode_pb2_grpc.DecodeRegionServicer):
    async def Reserve(self, request: decode_pb2.ReserveRequest, context: Any) -> decode_pb2.ReserveReply:  # noqa: N802
        return decode_pb2.ReserveReply(kv_endpoint="127.0.0.1:9", free_bytes=1 << 40, expires_in_s=request.ttl_s)

    async def Release(self, request: decode_pb2.ReleaseRequest, context: Any) -> decode_pb2.ReleaseReply:  # noqa: N802
        return decode_pb2.ReleaseReply(found=True)

    async def Decode(self, request: decode_pb2.DecodeRequest, context: Any) -> AsyncIterator[Any]:  # noqa: N802
        for i, token in enumerate(TOKENS):
            yield decode_pb2.TokenEvent(index=i, token=token, last=i == len(TOKENS) - 1, finish_reason="length")

    async def Cancel(self, request: common_pb2.CancelRequest, context: Any) -> common_pb2.CancelReply:  # noqa: N802
        return common_pb2.CancelReply()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, Services, FakeRegions]]:
    ensure_redis()
    prepare_model("tiny-llama")
    stack = Stack(Path(tmp_path_factory.mktemp("dispatch-scale")), min_split_tokens=1)
    services = Services.create(stack_settings(stack, policy_path=stack.env["PRFAAS_POLICY_PATH"]))
    regions = FakeRegions(services.regions, StallingPrefill(), InstantDecode())
    try:
        stack.start_worker("w1", concurrency=2)
        yield stack, services, regions
    finally:
        stack.stop()
        regions.close()
        stack.cleanup()
        services.close()


def test_500_jobs_in_flight_at_once_through_one_worker_of_concurrency_2(
    stack: tuple[Stack, Services, FakeRegions],
) -> None:
    _stack, services, regions = stack
    celery = make_celery(services.settings)
    tenant = "t-" + uuid.uuid4().hex[:8]
    quota = Quota(rps=100_000, concurrency=10_000, budget_usd=1e9)
    fields = {"model": "tiny-llama", "kind": "text_completion", "token_ids": list(range(1, 65)), "prompt_tokens": 64,
              "max_new_tokens": len(TOKENS), "temperature": 0.0, "placement_asked": "split"}  # fmt: skip
    started = time.monotonic()
    job_ids = [services.jobs.create(tenant, fields, quota).job_id for _ in range(JOBS)]
    for job_id in job_ids:
        enqueue(celery, job_id)
    wait_until(lambda: regions.prefill.started == JOBS, STALL_S + 60, 0.1)
    assert time.monotonic() - started < STALL_S + 60
    peak_while_stalled = regions.prefill.peak
    follower = Follower(services, celery)

    def follow(job_id: str) -> list[int]:
        return [t.token for t in follower.tokens(job_id)]

    with ThreadPoolExecutor(32) as pool:
        outputs = list(pool.map(follow, job_ids, timeout=120))
    assert outputs == [TOKENS] * JOBS
    states = {services.jobs.get(j)["state"] for j in job_ids}
    attempts = {services.jobs.get(j)["attempt"] for j in job_ids}
    assert states == {"DONE"} and attempts == {"1"}
    # every job's prefill was under way at once (2 worker threads could hold 2): the tasks returned
    assert peak_while_stalled == JOBS, peak_while_stalled
    celery.close()
