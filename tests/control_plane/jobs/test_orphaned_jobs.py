"""Jobs whose API process went away (real Redis, real gRPC): the sweeper's claim on an orphan (its follow) is given
back when acting on it fails, so a later pass finishes the job; a job not yet dispatched is dispatched; a job whose
request failed after it was written ends; and an orphan's regions are told beside the pass, after its move."""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest
import redis
from cp_kit import cleanup, ensure_redis, make_settings
from prometheus_client import CollectorRegistry

from prfaas.control_plane.api import completions
from prfaas.control_plane.api.deps import Generation
from prfaas.control_plane.api.metrics import ApiMetrics
from prfaas.control_plane.api.openai_schemas import CompletionCreate
from prfaas.control_plane.jobs.attempts import Attempts
from prfaas.control_plane.jobs.generation import Follower
from prfaas.control_plane.jobs.leases import Heartbeats, Leases
from prfaas.control_plane.jobs.states import JobState
from prfaas.control_plane.jobs.sweeper import Sweeper
from prfaas.control_plane.services import Services
from prfaas.control_plane.tenants import Quota, Tenant, TenantStatus
from prfaas.devstack.processes import wait_until
from prfaas.engine.sampling import SamplingParams
from prfaas.protos.prfaas.v1 import common_pb2, prefill_pb2_grpc
from prfaas.region.channels import ChannelCache
from prfaas.telemetry import tracing

QUOTA = Quota(rps=1000, concurrency=100, budget_usd=100.0)
DEAD = "api:host:1:dead"


@pytest.fixture
def services() -> Iterator[Services]:
    ensure_redis()
    settings = make_settings()
    services = Services.create(settings)
    services.redis.zadd(settings.key("beats", "api"), {DEAD: time.time() - 100})  # known, stopped beating
    yield services
    services.close()
    cleanup(settings)


class Sweeping:
    """A sweeper of its own (worker `worker:sweeper`) and what it did: dispatches queued, jobs adopted."""

    def __init__(self, services: Services, adopt: Callable[[str, int], None] | None = None) -> None:
        self.leases = Leases(services.redis, services.settings)
        self.queued: list[str] = []
        attempts = Attempts(services.jobs, self.leases, lambda job_id, _: self.queued.append(job_id), "worker:sweeper")
        beats = {kind: Heartbeats(services.redis, services.settings, kind) for kind in ("api", "worker")}
        self.sweeper = Sweeper(services.jobs, self.leases, attempts, beats, ChannelCache(None), adopt)


@pytest.fixture
def sweeping(services: Services) -> Iterator[Sweeping]:
    adopted: list[tuple[str, int]] = []
    sweeping = Sweeping(services, lambda job_id, after: adopted.append((job_id, after)))
    sweeping.adopted = adopted  # type: ignore[attr-defined]
    yield sweeping
    sweeping.sweeper.stop()


def _orphan(services: Services, **fields: Any) -> str:
    """A QUEUED job followed by the API process that died (written with no lease: what it had before its
    dispatch was queued is in `test_a_job_whose_api_process_died_before_queueing_its_dispatch_is_dispatched`)."""
    tenant = "t-" + uuid.uuid4().hex[:8]
    job_id = services.jobs.create(tenant, {"token_ids": [1, 2, 3]} | fields, QUOTA, reserve_usd=1.0).job_id
    Leases(services.redis, services.settings).follow(job_id, DEAD)
    return job_id


def test_an_orphan_whose_sweep_met_a_redis_error_is_failed_by_the_next_pass(
    services: Services, sweeping: Sweeping
) -> None:
    """Redis away a moment just after the sweeper took the orphan's follow (its claim): before, the follow was
    gone for good, and the job stayed QUEUED with no lease and its tenant's concurrency slot taken, forever."""
    job_id = _orphan(services)
    get = services.jobs.get

    def blip(job: str) -> dict[str, str]:
        services.jobs.get = get  # type: ignore[method-assign]
        raise redis.ConnectionError("Error 111 connecting to redis. Connection refused.")

    services.jobs.get = blip  # type: ignore[method-assign]
    with contextlib.suppress(redis.ConnectionError):
        sweeping.sweeper.sweep()
    sweeping.sweeper.sweep()
    job = services.jobs.get(job_id)
    assert job["state"] == JobState.FAILED and DEAD in job["error"], job
    assert services.jobs.active_count(job["tenant"]) == 0 and sweeping.leases.following() == {}


def test_an_orphan_whose_adoption_failed_is_adopted_by_the_next_pass(services: Services) -> None:
    calls: list[tuple[str, int]] = []

    def adopt(job_id: str, after: int) -> None:
        calls.append((job_id, after))
        if len(calls) == 1:
            raise RuntimeError("can't start new thread")

    sweeping = Sweeping(services, adopt)
    job_id = _orphan(services, idempotent=1)
    try:
        with contextlib.suppress(RuntimeError):
            sweeping.sweeper.sweep()
        sweeping.sweeper.sweep()
    finally:
        sweeping.sweeper.stop()
    assert calls == [(job_id, 0), (job_id, 0)]


class Prefill(prefill_pb2_grpc.PrefillRegionServicer):
    """A prefill region whose Cancel answers once the test lets it, noting the job's state when it came."""

    def __init__(self, services: Services) -> None:
        self.services = services
        self.states: list[str] = []
        self.answer = threading.Event()

    def Cancel(self, request: common_pb2.CancelRequest, context: Any) -> common_pb2.CancelReply:  # noqa: N802
        self.states.append(self.services.jobs.get(request.job_id)["state"])
        self.answer.wait(5)
        return common_pb2.CancelReply(found=True)


def test_an_orphan_ends_failed_then_its_regions_are_told_beside_the_pass(
    services: Services, sweeping: Sweeping
) -> None:
    """Before, the pass called Cancel first (2 s each, up to two per job, one job after another), then moved the
    job: a region that hangs held every other recovery up, and a sweeper that died meanwhile lost the job."""
    prefill = Prefill(services)
    server = grpc.server(futures.ThreadPoolExecutor(2))
    prefill_pb2_grpc.add_PrefillRegionServicer_to_server(prefill, server)
    target = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
    try:
        job_id = _orphan(services, prefill_grpc=target, prefill_region="prefill-a")
        started = time.monotonic()
        done = sweeping.sweeper.sweep()
        assert time.monotonic() - started < 1.5, done
        assert services.jobs.get(job_id)["state"] == JobState.FAILED
        prefill.answer.set()
        wait_until(lambda: prefill.states, 5)
        assert prefill.states == [JobState.FAILED]
    finally:
        prefill.answer.set()
        server.stop(None)


def test_a_job_whose_api_process_died_before_queueing_its_dispatch_is_dispatched(
    services: Services, sweeping: Sweeping
) -> None:
    """Written with an Idempotency-Key, its API process gone before it queued the dispatch: the job is adopted,
    and the `queued` lease written with it (owned by that process) gets its dispatch queued. Before, attempt 1
    had no lease: adopted, never dispatched, until the adopter's deadline."""
    tenant = "t-" + uuid.uuid4().hex[:8]
    job_id = services.jobs.create(tenant, {"token_ids": [1, 2, 3], "idempotent": 1}, QUOTA, follow_as=DEAD).job_id
    sweeping.sweeper.sweep()
    assert sweeping.queued == [job_id]
    assert sweeping.adopted == [(job_id, 0)]  # type: ignore[attr-defined]
    lease = sweeping.leases.get(job_id)
    assert lease is not None and (lease.attempt, lease.stage, lease.owner) == (1, "queued", "worker:sweeper")


def test_a_job_is_written_under_the_queued_lease_of_its_follower(services: Services) -> None:
    leases = Leases(services.redis, services.settings)
    before = time.time()
    job_id = services.jobs.create("t-" + uuid.uuid4().hex[:8], {"token_ids": [1]}, QUOTA, follow_as="api:one").job_id
    lease = leases.get(job_id)
    assert lease is not None and (lease.attempt, lease.stage, lease.owner) == (1, "queued", "api:one")
    assert before + services.settings.dispatch.visibility_s <= lease.deadline <= time.time() + 60
    unfollowed = services.jobs.create("t-" + uuid.uuid4().hex[:8], {"token_ids": [1]}, QUOTA).job_id
    assert leases.get(unfollowed) is None  # no follower whose death would be noticed: none


def test_a_request_that_fails_after_its_job_was_written_ends_the_job(
    services: Services, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before, only a broker error at the enqueue ended the job: any other error left it QUEUED, followed by this
    live process that would never read it, holding the tenant's concurrency slot until its keys expired."""

    def broken(*_: Any, **__: Any) -> None:
        raise RuntimeError("the Celery app is closing")

    monkeypatch.setattr(completions, "enqueue", broken)
    tenant = Tenant("t-" + uuid.uuid4().hex[:8], "acme", TenantStatus.ACTIVE, QUOTA, False, time.time())
    follower = Follower(services, None, owner="api:live")
    g = Generation(tenant, services, follower, ApiMetrics(CollectorRegistry()), None, None)
    body = CompletionCreate(model=services.model.name, prompt=[1, 2, 3], max_tokens=2)
    span = tracing.tracer.start_span("test")
    with pytest.raises(RuntimeError):
        completions._admitted(g, body, [1, 2, 3], SamplingParams(max_new_tokens=2), "auto", "text_completion", None,
                              [], time.perf_counter(), span)  # fmt: skip
    [job] = services.jobs.list_for(tenant.id)
    wait_until(lambda: services.jobs.get(job["id"])["state"] == JobState.FAILED, 5)
    assert services.jobs.active_count(tenant.id) == 0 and follower.leases.following() == {}
