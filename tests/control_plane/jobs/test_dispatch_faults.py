"""The dispatcher when a placement cannot be carried out through no instance's fault, and when following a
stage fails for a reason of ours (real Redis; the regions are test servicers on real gRPC servers, registered
in the fleet and beating, so each fault happens at the moment that matters, every run):

- the only decode instance is full at Reserve (RESOURCE_EXHAUSTED: a burst of dispatches raced for its buffer):
  the same attempt is placed again shortly; before, the instance was left out for good and the job FAILED
  "no placement" at its deadline, though the region had room a moment later; full every time, it is left
  out after FULL_RETRIES tries;
- the prefill region leaves between the snapshot and the pick (drained): placed again on a fresh snapshot
  (locally); before, the decode region was blamed and left out, and the job FAILED at its deadline;
- a Redis error while the watcher follows the prefill: the lease is left for the sweeper, which takes the
  attempt back at the lease's end; before, the lease was taken and nothing ever moved the job on; after the
  hand-off, the job decodes and its lease is taken as usual;
- the sweeper taking back overrun leases while a region's Cancel hangs, and a lease replaced since it read it."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
import redis
from cp_kit import services_fixture
from fake_regions import FakeRegions

from prfaas.control_plane.jobs.attempts import Attempts
from prfaas.control_plane.jobs.dispatch import FULL_RETRIES, Dispatcher
from prfaas.control_plane.jobs.leases import Heartbeats, Lease, Leases
from prfaas.control_plane.jobs.states import JobState
from prfaas.control_plane.jobs.sweeper import Sweeper
from prfaas.control_plane.services import Services
from prfaas.control_plane.tenants import Quota
from prfaas.protos.prfaas.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from prfaas.region.channels import ChannelCache

FIELDS = {"model": "tiny-llama", "kind": "text_completion", "token_ids": list(range(1, 65)), "prompt_tokens": 64,
          "max_new_tokens": 3, "temperature": 0.0, "placement_asked": "split"}  # fmt: skip


class Prefill(prefill_pb2_grpc.PrefillRegionServicer):
    cancel_s = 0.0  # how long a Cancel takes to answer (a region that hangs: 5 s, past the caller's 2 s)

    async def Prefill(self, request: Any, context: Any) -> Any:  # noqa: N802
        yield prefill_pb2.PrefillEvent(started=prefill_pb2.Started())
        kv = common_pb2.KVDescriptor(num_tokens=len(request.token_ids), dtype="float32")
        yield prefill_pb2.PrefillEvent(prefill_done=prefill_pb2.PrefillDone(first_token=11, kv=kv, prefill_s=0.01))
        yield prefill_pb2.PrefillEvent(shipment_complete=prefill_pb2.ShipmentComplete(raw_bytes=8, wire_bytes=4))

    async def Cancel(self, request: Any, context: Any) -> Any:  # noqa: N802
        await asyncio.sleep(self.cancel_s)
        return common_pb2.CancelReply()


class Decode(decode_pb2_grpc.DecodeRegionServicer):
    def __init__(self) -> None:
        self.reserves = 0
        self.full_for = 0  # this many Reserves are refused: the buffer is full
        self.prefill_lost = False  # Reserve ends ABORTED: its health watch on the prefill region broke meanwhile

    async def Reserve(self, request: Any, context: Any) -> Any:  # noqa: N802
        self.reserves += 1
        if self.prefill_lost:
            await context.abort(grpc.StatusCode.ABORTED, f"prefill region {request.prefill_region} is unavailable")
        if self.reserves <= self.full_for:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "KV buffer full")
        return decode_pb2.ReserveReply(kv_endpoint="127.0.0.1:9", free_bytes=1 << 40, expires_in_s=request.ttl_s)

    async def Release(self, request: Any, context: Any) -> Any:  # noqa: N802
        return decode_pb2.ReleaseReply(found=True)

    async def Cancel(self, request: Any, context: Any) -> Any:  # noqa: N802
        return common_pb2.CancelReply()


@pytest.fixture
def services() -> Iterator[Services]:
    yield from services_fixture(job={"timeout_s": 20})


@pytest.fixture
def regions(services: Services) -> Iterator[FakeRegions]:
    regions = FakeRegions(services.regions, Prefill(), Decode())
    yield regions
    regions.close()


def _job(services: Services) -> str:
    quota = Quota(rps=1000, concurrency=100, budget_usd=100)
    return services.jobs.create("t-" + uuid.uuid4().hex[:8], dict(FIELDS), quota).job_id


def _followed(dispatcher: Dispatcher, services: Services) -> str:
    """A new job dispatched, once the watcher has followed its prefill to the end."""
    job_id = _job(services)
    assert dispatcher.run(job_id) == "started"
    deadline = time.monotonic() + 10
    while dispatcher.watcher.in_flight and time.monotonic() < deadline:
        time.sleep(0.02)
    return job_id


def _dispatch(dispatcher: Dispatcher, queued: list[tuple[str, float]], job_id: str) -> list[str]:
    """Run the job's dispatch, and each one it queues again after its countdown (Celery's part), up to 5."""
    outcomes = [dispatcher.run(job_id)]
    while queued and len(outcomes) < 5:
        _, countdown = queued.pop(0)
        time.sleep(countdown)
        outcomes.append(dispatcher.run(job_id))
    return outcomes


def test_a_full_decode_instance_is_tried_again_not_left_out(services: Services, regions: FakeRegions) -> None:
    regions.decode.full_for = 1
    queued: list[tuple[str, float]] = []
    dispatcher = Dispatcher(services, lambda job_id, countdown: queued.append((job_id, countdown)), owner="worker:t")
    job_id = _job(services)
    assert _dispatch(dispatcher, queued, job_id) == ["unplaced", "started"]
    job = services.jobs.get(job_id)
    assert job["attempt"] == "1" and json.loads(job.get("excluded") or "[]") == [], job  # no attempt spent
    assert regions.decode.reserves == 2


def test_a_decode_instance_full_every_time_is_left_out_after_a_few_tries(
    services: Services, regions: FakeRegions
) -> None:
    """Not forever: a job larger than the instance's free buffer, or one it holds the prefix of, would be placed
    on it again and again until the job's deadline; after FULL_RETRIES the attempt fails and leaves it out."""
    regions.decode.full_for = 100
    queued: list[tuple[str, float]] = []
    dispatcher = Dispatcher(services, lambda job_id, countdown: queued.append((job_id, countdown)), owner="worker:t")
    job_id = _job(services)
    assert _dispatch(dispatcher, queued, job_id)[: FULL_RETRIES + 1] == ["unplaced"] * FULL_RETRIES + ["retrying"]
    job = services.jobs.get(job_id)
    assert job["attempt"] == "2" and [e.split("@")[0] for e in json.loads(job["excluded"])] == ["decode-t/i0"], job
    assert job["full_refusals"] == "0"  # the new attempt's own count


def test_a_reserve_that_lost_its_prefill_region_leaves_that_prefill_instance_out(
    services: Services, regions: FakeRegions
) -> None:
    """ABORTED (PrefillLost): the decode region is healthy, the prefill instance it was to receive from is not."""
    regions.decode.prefill_lost = True
    queued: list[tuple[str, float]] = []
    dispatcher = Dispatcher(services, lambda job_id, countdown: queued.append((job_id, countdown)), owner="worker:t")
    job_id = _job(services)
    assert dispatcher.run(job_id) == "retrying"
    job = services.jobs.get(job_id)
    assert [e.split("@")[0] for e in json.loads(job["excluded"])] == ["prefill-t/i0"], job


class Draining(Dispatcher):
    """The operator drains the prefill region just after the placement's snapshot was read."""

    drained = False

    def decide(self, job: dict[str, str], excluded: frozenset[str]) -> Any:
        decision = super().decide(job, excluded)
        if not self.drained:
            self.drained = True
            self.s.regions.set_drained("prefill-t", True)
        return decision


def test_a_prefill_region_gone_since_the_snapshot_is_placed_again_blaming_no_one(
    services: Services, regions: FakeRegions
) -> None:
    queued: list[tuple[str, float]] = []
    dispatcher = Draining(services, lambda job_id, countdown: queued.append((job_id, countdown)), owner="worker:t")
    job_id = _job(services)
    assert _dispatch(dispatcher, queued, job_id) == ["unplaced", "started"]
    job = services.jobs.get(job_id)
    assert (job["state"], job["attempt"]) == (JobState.LOCAL, "1"), job  # in decode-t, the region left to it
    assert json.loads(job.get("excluded") or "[]") == [], job


def test_a_redis_error_while_following_the_prefill_leaves_the_lease_to_the_sweeper(
    services: Services, regions: FakeRegions
) -> None:
    dispatcher = Dispatcher(services, lambda *_: None, owner="worker:t")
    post_ready = services.jobs.post_ready

    def unreachable(*args: Any, **kwargs: Any) -> None:  # Redis away when the hand-off is posted
        services.jobs.post_ready = post_ready  # type: ignore[method-assign]
        raise redis.ConnectionError("Error 111 connecting to redis. Connection refused.")

    services.jobs.post_ready = unreachable  # type: ignore[method-assign]
    job_id = _followed(dispatcher, services)
    assert dispatcher.watcher.in_flight == 0
    assert services.jobs.get(job_id)["state"] == JobState.TRANSFERRING
    lease = dispatcher.leases.get(job_id)
    assert lease is not None and lease.stage == "prefill", lease  # the sweeper takes the attempt back at its end


def test_a_redis_error_after_the_hand_off_leaves_the_decoding_job_alone(
    services: Services, regions: FakeRegions
) -> None:
    """The shipment's byte count not recorded (Redis away) once the job decodes: the lease is taken as usual, so
    the sweeper does not take back (cancel, retry) a job that is decoding fine."""
    dispatcher = Dispatcher(services, lambda *_: None, owner="worker:t")
    update = services.jobs.update

    def unreachable(job_id: str, attempt: int, **fields: Any) -> bool:
        if "bytes_wire" in fields:  # the shipment_complete event, after the hand-off
            raise redis.ConnectionError("Error 111 connecting to redis. Connection refused.")
        return update(job_id, attempt, **fields)

    services.jobs.update = unreachable  # type: ignore[method-assign]
    job_id = _followed(dispatcher, services)
    assert services.jobs.get(job_id)["state"] == JobState.TRANSFERRING
    assert dispatcher.leases.get(job_id) is None


def _sweeper(services: Services) -> tuple[Sweeper, Leases]:
    leases = Leases(services.redis, services.settings)
    beats = {"worker": Heartbeats(services.redis, services.settings, "worker")}
    attempts = Attempts(services.jobs, leases, lambda *_: None, "worker:sweeper")
    return Sweeper(services.jobs, leases, attempts, beats, ChannelCache(None)), leases


def _prefilling(services: Services, leases: Leases, regions: FakeRegions, owner: str, deadline: float) -> str:
    """A job whose attempt 1 prefills in prefill-t under `owner`'s lease."""
    job_id = _job(services)
    target = regions.registry.get("prefill-t").instance("i0")
    assert target is not None
    services.jobs.update(job_id, 1, prefill_grpc=target.grpc_endpoint, prefill_region="prefill-t")
    services.jobs.transition(job_id, JobState.PREFILLING, 1, note="prefill")
    leases.grant(Lease(job_id, 1, "prefill", owner, "prefill-t/i0", deadline))
    return job_id


def test_the_sweeper_moves_each_job_on_before_telling_a_hanging_region(
    services: Services, regions: FakeRegions
) -> None:
    """Five overrun prefill leases on a region whose Cancel hangs: one pass moves all five jobs to their next
    attempt at once (before, each waited for its Cancel's 2 s deadline first, one after another, and a sweeper
    killed in between left a job with no lease that nothing ever took back)."""
    regions.prefill.cancel_s = 5.0
    sweeper, leases = _sweeper(services)
    jobs = [_prefilling(services, leases, regions, "worker:live", time.time() - 1) for _ in range(5)]
    started = time.monotonic()
    done = sweeper.sweep()
    assert time.monotonic() - started < 2.0, done
    assert [services.jobs.get(job_id)["attempt"] for job_id in jobs] == ["2"] * 5
    sweeper.stop()


def test_the_sweeper_takes_only_the_lease_it_read(services: Services, regions: FakeRegions) -> None:
    """An overrun lease read by the sweeper, replaced (same attempt) by a live worker's just after the read: the
    new lease is left alone and the job is not retried (before, the take matched the attempt only: it removed
    the live worker's lease and started attempt 2 beside the live one)."""
    sweeper, leases = _sweeper(services)
    job_id = _prefilling(services, leases, regions, "worker:gone", time.time() - 1)

    class Racing(Leases):
        def all(self) -> list[Lease]:
            read = super().all()
            self.grant(Lease(job_id, 1, "prefill", "worker:live", "prefill-t/i0", time.time() + 60))
            return read

    sweeper.leases = Racing(services.redis, services.settings)
    assert sweeper.sweep() == []
    held = leases.get(job_id)
    assert held is not None and held.owner == "worker:live"
    assert services.jobs.get(job_id)["attempt"] == "1"
    sweeper.stop()


class Breaking(Prefill):
    """The prefill's worker is lost once it started: the stream breaks (UNAVAILABLE)."""

    async def Prefill(self, request: Any, context: Any) -> Any:  # noqa: N802
        yield prefill_pb2.PrefillEvent(started=prefill_pb2.Started())
        await context.abort(grpc.StatusCode.UNAVAILABLE, "prefill worker lost")


class Releasing(Decode):
    """Notes, when a Release comes, what the job and its lease were then: what a worker that died during the
    Release would have left."""

    def __init__(self, services: Services) -> None:
        super().__init__()
        self.services = services
        self.seen: list[tuple[str, str, Lease | None]] = []

    async def Release(self, request: Any, context: Any) -> Any:  # noqa: N802
        job = self.services.jobs.get(request.job_id)
        lease = Leases(self.services.redis, self.services.settings).get(request.job_id)
        self.seen.append((job["state"], job["attempt"], lease))
        return decode_pb2.ReleaseReply(found=True)


def test_a_broken_prefill_queues_the_next_attempt_before_releasing_its_reservation(services: Services) -> None:
    """Before, the watcher took the prefill lease, awaited the Release (up to 5 s), then failed the attempt: a
    worker that died during the Release left the job PREFILLING with no lease, which nothing ever took back."""
    decode = Releasing(services)
    regions = FakeRegions(services.regions, Breaking(), decode)
    try:
        dispatcher = Dispatcher(services, lambda *_: None, owner="worker:t")
        job_id = _followed(dispatcher, services)
    finally:
        regions.close()
    [(state, attempt, lease)] = decode.seen
    assert (state, attempt) == (JobState.QUEUED, "2"), decode.seen
    assert lease is not None and (lease.attempt, lease.stage, lease.owner) == (2, "queued", "worker:t")
    assert services.jobs.get(job_id)["attempt"] == "2"


def test_the_no_region_wait_starts_when_the_attempt_first_finds_no_region() -> None:
    """A job that waited a minute for a busy fleet (allowed, until its deadline), whose regions then blink, waits
    `no_region_wait_s` from then for them; before, the wait counted from the attempt's start and it failed at
    once. No region is registered here: every dispatch finds none (NO_ELIGIBLE_REGION)."""
    for services in services_fixture(job={"timeout_s": 300}, dispatch={"no_region_wait_s": 1.5}):
        dispatcher = Dispatcher(services, lambda *_: None, owner="worker:t")  # the test runs each dispatch itself
        job_id = _job(services)
        minute_ago = str(time.time() - 60)  # its QUEUED entry a minute ago: the busy fleet's wait
        services.redis.hset(services.jobs._job(job_id), mapping={"created_at": minute_ago, "updated_at": minute_ago})
        assert dispatcher.run(job_id) == "unplaced"
        assert services.jobs.get(job_id)["no_region_since"].startswith("1:")
        time.sleep(1.0)  # the next dispatch (UNPLACED_RETRY_S) is past the wait: failed, saying why
        assert dispatcher.run(job_id) == "rejected"
        job = services.jobs.get(job_id)
        assert job["state"] == JobState.FAILED and "no region in the snapshot can decode" in job["error"], job
