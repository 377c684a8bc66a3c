"""How the API's decode stream ends, and whom it blames (jobs/generation.py, jobs/decode_calls.py), against
test servicers on real gRPC (real Redis): a Decode that ends PREFILL_LOST (the decode region lost the prefill
instance that owed its KV) leaves that prefill instance out, not the decode one, and reships nothing from it;
a stream ends with the job's deadline, and the client hears of the timeout without waiting for a hung
region's Cancel; a region that hangs mid-stream (SIGSTOP) breaks the stream in seconds (keepalive)."""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest
from cp_kit import services_fixture
from grpc_health.v1 import health_pb2, health_pb2_grpc

from prfaas.control_plane.jobs.celery_app import make_celery
from prfaas.control_plane.jobs.decode_calls import KEEPALIVE_S
from prfaas.control_plane.jobs.errors import JobEnded
from prfaas.control_plane.jobs.generation import Follower
from prfaas.control_plane.jobs.states import JobState
from prfaas.control_plane.services import Services
from prfaas.control_plane.tenants import Quota
from prfaas.engine.sampling import SamplingParams
from prfaas.protos.prfaas.v1 import common_pb2, decode_pb2, decode_pb2_grpc

QUOTA = Quota(rps=1000, concurrency=100, budget_usd=100.0)
TOKENS = [101, 102, 103]
JOB_TIMEOUT_S = 2.0


class Decode(decode_pb2_grpc.DecodeRegionServicer):
    """Attempt 1 ends with `first_status` (None: hangs until `release`); later attempts stream TOKENS. Cancel
    hangs while `hang_cancel` is set (a region that stopped answering)."""

    def __init__(self, first_status: tuple[grpc.StatusCode, str] | None, hang_cancel: bool = False) -> None:
        self.first_status = first_status
        self.hang_cancel = hang_cancel
        self.release = threading.Event()

    def Cancel(self, request: common_pb2.CancelRequest, context: Any) -> common_pb2.CancelReply:  # noqa: N802
        if self.hang_cancel:
            self.release.wait(30)
        return common_pb2.CancelReply(found=True)

    def Decode(self, request: decode_pb2.DecodeRequest, context: Any) -> Iterator[decode_pb2.TokenEvent]:  # noqa: N802
        if request.attempt == 1:
            if self.first_status is None:
                self.release.wait(30)
                return
            context.abort(*self.first_status)
        for index, token in enumerate(TOKENS):
            last = index == len(TOKENS) - 1
            yield decode_pb2.TokenEvent(index=index, token=token, last=last, finish_reason="length" if last else "")


@pytest.fixture
def services() -> Iterator[Services]:
    yield from services_fixture(job={"timeout_s": JOB_TIMEOUT_S})


def _serve(servicer: Decode) -> tuple[grpc.Server, str]:
    server = grpc.server(futures.ThreadPoolExecutor(4))
    decode_pb2_grpc.add_DecodeRegionServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


def _split_job(services: Services, target: str) -> str:
    """A split job at attempt 1, prefilled in p/i0 and handed off to decode d/i0 at `target`."""
    sampling = SamplingParams(max_new_tokens=len(TOKENS), ignore_eos=True).to_dict()
    record = {"token_ids": [1, 2, 3], "prompt_tokens": 3, "max_new_tokens": len(TOKENS), "sampling": sampling}
    job_id = services.jobs.create("t-" + uuid.uuid4().hex[:8], record, QUOTA, reserve_usd=1.0).job_id
    _hand_off(services, job_id, 1, target)
    return job_id


def _hand_off(services: Services, job_id: str, attempt: int, target: str) -> None:
    services.jobs.transition(job_id, JobState.PREFILLING, attempt)
    services.jobs.transition(job_id, JobState.TRANSFERRING, attempt)
    services.jobs.update(job_id, attempt, decode_grpc=target, decode_region="d", decode_instance="i0",
                         prefill_region="p", prefill_instance="i0")  # fmt: skip
    kv = base64.b64encode(common_pb2.KVDescriptor(num_tokens=3).SerializeToString()).decode()
    services.jobs.post_ready(job_id, attempt, {"mode": "split", "decode_grpc": target, "decode_region": "d",
                                               "kv": kv, "first_token": TOKENS[0]})  # fmt: skip


def _follow(services: Services, job_id: str, target: str) -> tuple[list[int], dict[str, str], list[str]]:
    """The job's tokens, its record when attempt 2 was queued (then handed off to `target`), and the
    instances the follower suspected."""
    suspected: list[str] = []
    services.regions.suspect = suspected.append  # type: ignore[method-assign]
    queued: dict[str, str] = {}

    def next_attempt() -> None:  # what the dispatcher does for attempt 2: its record read first
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and services.jobs.get(job_id)["attempt"] != "2":
            time.sleep(0.02)
        queued.update(services.jobs.get(job_id))
        _hand_off(services, job_id, 2, target)

    dispatcher = threading.Thread(target=next_attempt, daemon=True)
    dispatcher.start()
    celery = make_celery(services.settings)
    try:
        tokens = [t.token for t in Follower(services, celery).tokens(job_id)]
    finally:
        celery.close()
    dispatcher.join(10)
    return tokens, queued, suspected


def _followed_against(services: Services, servicer: Decode) -> tuple[list[int], dict[str, str], list[str]]:
    """`_follow` of a new split job whose decode region is `servicer`, on a gRPC server of its own."""
    server, target = _serve(servicer)
    try:
        return _follow(services, _split_job(services, target), target)
    finally:
        server.stop(None)


def test_a_decode_whose_prefill_was_lost_leaves_the_prefill_instance_out_not_the_decode_one(
    services: Services,
) -> None:
    """Before, ABORTED cost the decode instance the job (left out) and reshipped from the lost prefill."""
    servicer = Decode((grpc.StatusCode.ABORTED, "prefill region 127.0.0.1:9 is unavailable (UNAVAILABLE: ping)"))
    tokens, queued, suspected = _followed_against(services, servicer)
    assert tokens == TOKENS
    excluded = json.loads(queued["excluded"])
    assert [e.split("@")[0] for e in excluded] == ["p/i0"], excluded  # ["d/i0"] before
    assert not queued.get("reship_from"), queued  # the prompt is computed again: the lost instance may hang
    assert suspected == []  # the decode instance did nothing wrong


def test_a_decode_instance_that_went_away_is_still_left_out_and_the_kv_reshipped(services: Services) -> None:
    servicer = Decode((grpc.StatusCode.UNAVAILABLE, "decode region shutting down"))
    tokens, queued, suspected = _followed_against(services, servicer)
    assert tokens == TOKENS
    assert [e.split("@")[0] for e in json.loads(queued["excluded"])] == ["d/i0"]
    assert json.loads(queued["reship_from"]) == {"region": "p", "instance": "i0"}
    assert suspected == ["d/i0"]


def test_a_decode_call_canceled_there_leaves_no_instance_out(services: Services) -> None:
    """A decode stream that ends CANCELLED was canceled in its region by the control plane (a sweeper, a newer
    call for the job): no fault of the instance, which the next attempt may use. Before, it was left out, and
    with one decode instance the job failed with `no decode region`."""
    servicer = Decode((grpc.StatusCode.CANCELLED, "canceled: superseded by a newer call"))
    tokens, queued, suspected = _followed_against(services, servicer)
    assert tokens == TOKENS
    assert json.loads(queued.get("excluded") or "[]") == [], queued
    assert json.loads(queued["reship_from"]) == {"region": "p", "instance": "i0"} and suspected == []


def test_a_hung_decode_ends_the_job_at_its_deadline_without_waiting_for_the_regions_cancel(
    services: Services,
) -> None:
    """Before, the stream outlived the job's deadline by 5 s, then Cancel waited 2 s on the hung region."""
    servicer = Decode(None, hang_cancel=True)
    server, target = _serve(servicer)
    try:
        job_id = _split_job(services, target)
        celery = make_celery(services.settings)
        started = time.monotonic()
        with pytest.raises(JobEnded) as ended:
            list(Follower(services, celery).tokens(job_id))
        waited_s = time.monotonic() - started
        celery.close()
    finally:
        servicer.release.set()
        server.stop(None)
    assert ended.value.state == "TIMEOUT"
    assert waited_s < JOB_TIMEOUT_S + 1.5, waited_s  # ~9 s before
    assert services.jobs.get(job_id)["state"] == JobState.CANCELED


HUNG_SERVER = """
import sys
from concurrent import futures
import grpc
from grpc_health.v1 import health, health_pb2_grpc
from prfaas.region.channels import SERVER_OPTIONS
server = grpc.server(futures.ThreadPoolExecutor(4), options=SERVER_OPTIONS)  # a region's server options
health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
print(server.add_insecure_port("127.0.0.1:0"), flush=True)
server.start()
server.wait_for_termination()
"""


def test_a_region_that_hangs_mid_stream_breaks_the_stream_in_seconds(services: Services) -> None:
    """A region stopped (SIGSTOP) keeps its TCP connection open and answers nothing: the follower's
    channels notice it by keepalive within an interval and max(2 s, an interval). Before, the stream
    waited for its deadline (the job's, 300 s by default)."""
    proc = subprocess.Popen([sys.executable, "-c", HUNG_SERVER], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        channel = Follower(services, None).channels.get(f"127.0.0.1:{port}", "d")
        stream = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=60)
        assert next(stream).status == health_pb2.HealthCheckResponse.SERVING
        os.kill(proc.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        with pytest.raises(grpc.RpcError) as broken:
            next(stream)
        broke_s = time.monotonic() - stopped
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.wait(10)
    assert broken.value.code() == grpc.StatusCode.UNAVAILABLE, broken.value  # DEADLINE_EXCEEDED at 60 s before
    assert broke_s < 2 * KEEPALIVE_S + 5, broke_s
