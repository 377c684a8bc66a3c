"""Callers that act on an attempt the job has left (real Redis): a late `Attempts.fail`, a DONE refused as stale,
the sweeper queueing a dispatch again, and `JobStore.update` on a job written busily. A late caller must change
nothing of the newer attempt: not its lease, not its token log, not its claim."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from cp_kit import cleanup, ensure_redis, make_settings

from prfaas.control_plane.jobs.attempts import Attempts
from prfaas.control_plane.jobs.errors import StaleAttempt
from prfaas.control_plane.jobs.leases import Lease, Leases
from prfaas.control_plane.jobs.states import JobState
from prfaas.control_plane.jobs.store import JobStore
from prfaas.control_plane.jobs.tokenlog import Token, TokenLog
from prfaas.control_plane.settings import Settings
from prfaas.control_plane.tenants import Quota

QUOTA = Quota(rps=1000, concurrency=100, budget_usd=100.0)


@pytest.fixture
def settings() -> Iterator[Settings]:
    ensure_redis()
    settings = make_settings()
    yield settings
    cleanup(settings)


@pytest.fixture
def store(settings: Settings) -> Iterator[JobStore]:
    client = redis.Redis.from_url(settings.redis_url)
    yield JobStore(client, settings)
    client.close()


@pytest.fixture
def leases(store: JobStore) -> Leases:
    return Leases(store.redis, store.settings)


def _attempts(store: JobStore, leases: Leases, owner: str, queued: list[str] | None = None) -> Attempts:
    return Attempts(store, leases, lambda job_id, _countdown: (queued if queued is not None else []).append(job_id),
                    owner)  # fmt: skip


def _job(store: JobStore) -> str:
    return store.create("t-" + uuid.uuid4().hex[:8], {"token_ids": [1, 2, 3]}, QUOTA).job_id


def _claimed(leases: Leases, job_id: str, attempt: int, owner: str = "worker:placing") -> Lease:
    """What a dispatcher's claim on `attempt` leaves: the job claimed, under its placing lease."""
    placing = Lease(job_id, attempt, "placing", owner, "", time.time() + 30)
    assert leases.claim_dispatch(placing) == "ok"
    return placing


def test_a_late_fail_leaves_the_next_attempts_prefill_lease_alone(store: JobStore, leases: Leases) -> None:
    """Attempt 1 failed (its decode stream broke) and attempt 2 prefills under its lease; then a second caller
    fails attempt 1 (the watcher after its 5 s Release, a sweeper after its Cancel). Before, its `queued` lease
    for attempt 2 replaced the prefill lease and was then dropped: the prefilling job had no lease at all."""
    job_id = _job(store)
    attempts = _attempts(store, leases, "api:one")
    assert attempts.fail(job_id, 1, "decode-a/i0", "decode lost") == "retrying"
    _claimed(leases, job_id, 2)
    store.transition(job_id, JobState.PREFILLING, 2)
    prefill = Lease(job_id, 2, "prefill", "worker:placing", "prefill-a/i0", time.time() + 30)
    assert leases.grant(prefill)

    assert _attempts(store, leases, "worker:late").fail(job_id, 1, "prefill-a/i0", "stream broke") == "superseded"
    assert leases.get(job_id) == prefill
    job = store.get(job_id)
    assert (job["state"], job["attempt"]) == (JobState.PREFILLING, "2")
    assert [e.split("@")[0] for e in json.loads(job["excluded"])] == ["decode-a/i0"]  # by incarnation: key@time


def test_a_late_fail_leaves_a_claimed_dispatch_its_placing_lease(store: JobStore, leases: Leases) -> None:
    """Attempt 2 is being placed (claimed, placing lease) when a late caller fails attempt 1. Before, the placing
    lease became a `queued` one owned by the late caller: the placing worker's death went unnoticed, and each
    requeue found the attempt claimed, so nothing ever dispatched it."""
    job_id = _job(store)
    assert _attempts(store, leases, "api:one").fail(job_id, 1, "", "decode lost") == "retrying"
    placing = _claimed(leases, job_id, 2)
    queued: list[str] = []
    assert _attempts(store, leases, "api:two", queued).fail(job_id, 1, "", "decode lost, seen again") == "superseded"
    assert leases.get(job_id) == placing and queued == []


def test_a_fail_refused_as_stale_grants_no_lease(store: JobStore, leases: Leases) -> None:
    """The attempt moves on between the late caller's read and its move: the move is refused in Redis, and the
    lease that guards the next attempt comes with the move, so the refused one grants none (before, it was
    granted before the move and taken back after, over whatever lease the newer attempt held meanwhile)."""
    job_id = _job(store)
    late = _attempts(store, leases, "worker:late")
    get = store.get

    def read_then_moved_on(job: str) -> dict[str, str]:
        record = get(job)
        store.get = get  # type: ignore[method-assign]
        assert _attempts(store, leases, "api:one").fail(job_id, 1, "", "decode lost") == "retrying"
        _claimed(leases, job_id, 2)
        return record

    store.get = read_then_moved_on  # type: ignore[method-assign]
    assert late.fail(job_id, 1, "", "stream broke") == "superseded"
    lease = leases.get(job_id)
    assert lease is not None and (lease.attempt, lease.stage, lease.owner) == (2, "placing", "worker:placing")


def test_a_retry_is_queued_with_its_lease_in_one_step(store: JobStore, leases: Leases) -> None:
    job_id = _job(store)
    queued: list[str] = []
    assert _attempts(store, leases, "worker:a", queued).fail(job_id, 1, "", "prefill lost") == "retrying"
    lease = leases.get(job_id)
    assert lease is not None and (lease.attempt, lease.stage, lease.owner) == (2, "queued", "worker:a")
    assert queued == [job_id]


def test_the_sweeper_queues_again_only_a_dispatch_nobody_claimed(store: JobStore, leases: Leases) -> None:
    """A `queued` lease the sweeper took, and a dispatch that claimed the attempt just after: the claim's placing
    lease is kept and no second dispatch is queued (before, a `queued` lease replaced the placing one)."""
    job_id = _job(store)
    queued: list[str] = []
    attempts = _attempts(store, leases, "worker:sweeper", queued)
    assert attempts.fail(job_id, 1, "", "prefill lost") == "retrying"
    taken = leases.get(job_id)
    assert taken is not None and leases.take_exact(taken)  # the sweeper's claim on it
    placing = _claimed(leases, job_id, 2)
    queued.clear()

    attempts.requeue(job_id, 2)
    assert leases.get(job_id) == placing and queued == []
    store.transition(job_id, JobState.CANCELED, 0)
    attempts.requeue(job_id, 2)  # nor one that ended
    assert queued == []


def test_a_done_refused_as_stale_logs_no_token(store: JobStore) -> None:
    """Attempt 1's last token comes after a sweeper queued attempt 2: its DONE is refused, and its token must not
    be in the log (before, it was appended whatever the move's outcome: a follower adopting the job read the
    output as complete, skipped every token of attempt 2 and never ended the job)."""
    job_id = _job(store)
    log = TokenLog(store)
    store.transition(job_id, JobState.LOCAL, 1)
    log.log_token(job_id, Token(0, 11, False, ""))
    store.transition(job_id, JobState.QUEUED, 2)
    with pytest.raises(StaleAttempt):
        store.transition(job_id, JobState.DONE, 1, log_token=Token(1, 12, True, "length").entry())
    assert [(t.index, t.token) for t in log.logged_tokens(job_id, 0)] == [(0, 11)]


def test_an_update_holds_on_a_job_written_busily(store: JobStore) -> None:
    """Another write to the job lands between every read of its attempt and the write of the fields (a busy job:
    the watcher's byte counts, the API's moves): the update is made all the same (before, WATCH/MULTI gave up
    after 10 conflicts and answered False, which its callers read as a newer attempt)."""
    job_id = _job(store)
    other = redis.Redis.from_url(store.settings.redis_url)
    pipeline = store.redis.pipeline

    def interfered(*args: Any, **kwargs: Any) -> Any:
        pipe = pipeline(*args, **kwargs)
        multi = pipe.multi

        def write_then_multi() -> None:
            other.hset(store.settings.key("job", job_id), "updated_at", time.time())
            multi()

        pipe.multi = write_then_multi
        return pipe

    store.redis.pipeline = interfered
    try:
        assert store.update(job_id, 1, bytes_raw=8)
        assert store.get(job_id)["bytes_raw"] == "8"
        assert not store.update(job_id, 2, bytes_raw=9)  # a stale attempt's is still refused
        assert store.get(job_id)["bytes_raw"] == "8"
    finally:
        store.redis.pipeline = pipeline
        other.close()
