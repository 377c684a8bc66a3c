"""The Redis job store on the real Redis: atomic, legal-only transitions, stale attempts
refused, timeline, idempotency, admission, billing once, TTL on finished jobs."""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis
from cp_kit import settings_fixture

from prfaas.control_plane.jobs.errors import AdmissionRefused, IllegalTransition, JobNotFound, StaleAttempt
from prfaas.control_plane.jobs.states import JobState
from prfaas.control_plane.jobs.store import JobStore
from prfaas.control_plane.settings import AdmissionSection, Settings
from prfaas.control_plane.tenants import Quota

ROOMY = Quota(rps=1000, concurrency=1000, budget_usd=1000)


@pytest.fixture
def settings() -> Iterator[Settings]:
    yield from settings_fixture(job={"ttl_s": 60})


@pytest.fixture
def store(settings: Settings) -> Iterator[JobStore]:
    client = redis.Redis.from_url(settings.redis_url)
    yield JobStore(client, settings)
    client.close()


def test_split_path_records_every_transition_in_order(store: JobStore) -> None:
    job = store.create("acme", {"model": "tiny-llama"}, ROOMY).job_id
    for state in (JobState.PREFILLING, JobState.TRANSFERRING, JobState.DECODING):
        store.transition(job, state, 1)
    store.transition(job, JobState.DONE, 1, cost_usd=0.25, completion_tokens=4)

    record = store.get(job)
    assert record["state"] == "DONE" and record["completion_tokens"] == "4"
    assert [e["state"] for e in store.timeline(job)] == ["QUEUED", "PREFILLING", "TRANSFERRING", "DECODING", "DONE"]
    assert store.spend("acme") == pytest.approx(0.25)
    assert store.active_count("acme") == 0
    assert 0 < store.redis.ttl(store.settings.key("job", job)) <= 60  # finished: TTL set


def test_illegal_moves_are_refused_and_change_nothing(store: JobStore) -> None:
    job = store.create("acme", {}, ROOMY).job_id
    with pytest.raises(IllegalTransition):
        store.transition(job, JobState.DECODING, 1)  # QUEUED -> DECODING skips prefill
    store.transition(job, JobState.LOCAL, 1)
    store.transition(job, JobState.DONE, 1)
    for target in (JobState.CANCELED, JobState.DONE, JobState.FAILED, JobState.QUEUED):
        with pytest.raises(IllegalTransition):
            store.transition(job, target, 1 if target is not JobState.QUEUED else 2)
    assert store.get(job)["state"] == "DONE"
    assert len(store.timeline(job)) == 3
    assert store.redis.ttl(store.settings.key("job", job)) > 0


def test_stale_attempt_is_ignored_after_a_retry(store: JobStore) -> None:
    job = store.create("acme", {}, ROOMY).job_id
    store.transition(job, JobState.PREFILLING, 1)
    assert store.transition(job, JobState.QUEUED, 2, note="prefill region lost") == 2
    with pytest.raises(StaleAttempt) as info:
        store.transition(job, JobState.TRANSFERRING, 1)  # the old attempt's late message
    assert info.value.current == 2
    with pytest.raises(StaleAttempt):
        store.transition(job, JobState.QUEUED, 2)  # a retry must be attempt + 1
    assert not store.update(job, 1, bytes_raw=5)
    assert store.update(job, 2, bytes_raw=5)
    store.transition(job, JobState.PREFILLING, 2)
    assert store.get(job)["bytes_raw"] == "5"
    assert [(e["state"], e["attempt"]) for e in store.timeline(job)] == [
        ("QUEUED", 1), ("PREFILLING", 1), ("QUEUED", 2), ("PREFILLING", 2),
    ]  # fmt: skip


def test_concurrent_racers_only_one_wins(store: JobStore) -> None:
    job = store.create("acme", {}, ROOMY).job_id
    store.transition(job, JobState.LOCAL, 1)

    def finish(_: int) -> bool:
        try:
            store.transition(job, JobState.DONE, 1, cost_usd=1.0)
            return True
        except IllegalTransition:
            return False

    with ThreadPoolExecutor(8) as pool:
        wins = list(pool.map(finish, range(32)))
    assert wins.count(True) == 1
    assert store.spend("acme") == pytest.approx(1.0)  # billed exactly once


def test_tenant_cancel_takes_any_attempt(store: JobStore) -> None:
    job = store.create("acme", {}, ROOMY).job_id
    store.transition(job, JobState.PREFILLING, 1)
    store.transition(job, JobState.QUEUED, 2)
    store.transition(job, JobState.CANCELED, 0, note="tenant")
    assert store.get(job)["state"] == "CANCELED"
    assert store.active_count("acme") == 0


def test_idempotency_key_returns_the_same_job(store: JobStore) -> None:
    first = store.create("acme", {}, ROOMY, idempotency_key="k-1")
    again = store.create("acme", {}, ROOMY, idempotency_key="k-1")
    other_tenant = store.create("globex", {}, ROOMY, idempotency_key="k-1")
    assert (again.job_id, again.existing, first.existing) == (first.job_id, True, False)
    assert other_tenant.job_id != first.job_id
    assert [j["id"] for j in store.list_for("acme")] == [first.job_id]


def test_admission_concurrency_rate_and_budget(store: JobStore) -> None:
    store.create("a", {}, Quota(rps=100, concurrency=1, budget_usd=10))
    with pytest.raises(AdmissionRefused, match="concurrency"):
        store.create("a", {}, Quota(rps=100, concurrency=1, budget_usd=10))
    refused = []
    for _ in range(10):  # 10 creates within at most two 1 s windows of 3: at least 4 refused
        try:
            store.create("b", {}, Quota(rps=3, concurrency=100, budget_usd=10))
        except AdmissionRefused as exc:
            refused.append(exc.reason)
    assert len(refused) >= 4 and set(refused) == {"rate"}
    job = store.create("c", {}, Quota(rps=100, concurrency=100, budget_usd=1)).job_id
    store.transition(job, JobState.LOCAL, 1)
    store.transition(job, JobState.DONE, 1, cost_usd=1.5)
    with pytest.raises(AdmissionRefused, match="budget"):
        store.create("c", {}, Quota(rps=100, concurrency=100, budget_usd=1))


def test_unknown_job_and_other_tenant_are_not_found(store: JobStore) -> None:
    job = store.create("acme", {}, ROOMY).job_id
    with pytest.raises(JobNotFound):
        store.get_for("globex", job)
    with pytest.raises(JobNotFound):
        store.transition("00000000-0000-0000-0000-000000000000", JobState.DONE, 1)


def test_ready_hand_off_waits_with_a_deadline(store: JobStore) -> None:
    job = store.create("acme", {}, ROOMY).job_id
    assert store.wait_ready(job, 0, timeout_s=0.05) is None
    store.post_ready(job, 1, {"mode": "local"})
    assert store.wait_ready(job, 0, timeout_s=1) == {"attempt": 1, "mode": "local"}
    assert store.wait_ready(job, 1, timeout_s=0.05) is None


def test_ready_hand_off_wakes_waiters_of_every_process_and_a_terminal_move_ends_the_wait(settings: Settings) -> None:
    # two stores on their own clients stand for two API processes following the same job
    clients = [redis.Redis.from_url(settings.redis_url) for _ in range(2)]
    first, second = (JobStore(client, settings) for client in clients)
    try:
        job = first.create("acme", {}, ROOMY).job_id
        with ThreadPoolExecutor(2) as pool:
            waits = [pool.submit(store.wait_ready, job, 0, 10.0) for store in (first, second)]
            time.sleep(0.2)  # both are blocked on the notify channel
            assert not any(w.done() for w in waits)
            posted = time.monotonic()
            first.post_ready(job, 1, {"mode": "local"})
            assert [w.result(5) for w in waits] == [{"attempt": 1, "mode": "local"}] * 2
            assert time.monotonic() - posted < 0.5  # woken by the notice (the re-read is every 1 s)
            # the hand-off stays readable (not consumed); the next attempt's wait ends at a terminal move
            waiting = pool.submit(second.wait_ready, job, 1, 10.0)
            time.sleep(0.2)
            ended = time.monotonic()
            first.transition(job, JobState.CANCELED, 0, note="tenant")
            assert waiting.result(5) is None
            assert time.monotonic() - ended < 0.5
    finally:
        for client in clients:
            client.close()


# -- admission around tokenizing, budget reservations, idempotency, key lifetimes ---------------------


def test_a_refused_admission_gives_its_slot_and_rate_count_back(store: JobStore) -> None:
    quota = Quota(rps=1, concurrency=1, budget_usd=10)
    held = store.admit("acme", quota)  # tokenizing: it holds the tenant's only slot and its one request a second
    with pytest.raises(AdmissionRefused, match="concurrency"):
        store.admit("acme", quota)
    store.release(held)  # the prompt was too long for the model, say
    store.release(held)  # idempotent: gives back nothing more
    again = store.admit("acme", quota)  # the slot and the rate count are free again (same second or next)
    created = store.create("acme", {"model": "tiny-llama"}, quota, admission=again)
    assert not created.existing and store.active_count("acme") == 1
    store.release(again)  # after create: a no-op, the job keeps its slot
    with pytest.raises(AdmissionRefused, match="concurrency"):
        store.admit("acme", quota)


def test_an_admission_never_created_lapses_after_the_hold(settings: Settings) -> None:
    client = redis.Redis.from_url(settings.redis_url)
    store = JobStore(client, settings.model_copy(update={"admission": AdmissionSection(hold_s=0.3)}))
    quota = Quota(rps=100, concurrency=1, budget_usd=10)
    store.admit("acme", quota)  # its process died while tokenizing: nobody releases it
    with pytest.raises(AdmissionRefused, match="concurrency"):
        store.admit("acme", quota)
    time.sleep(0.4)
    store.admit("acme", quota)
    client.close()


def test_budget_reservations_prevent_overshoot_with_concurrent_jobs(store: JobStore) -> None:
    """16 jobs of a predicted $0.30 each race for a $1.00 budget: 3 fit (0.90), the 4th would pass it."""
    quota = Quota(rps=1000, concurrency=1000, budget_usd=1.0)

    def submit(_: int) -> str:
        try:
            return store.create("acme", {"model": "tiny-llama"}, quota, reserve_usd=0.3).job_id
        except AdmissionRefused as exc:
            return exc.reason

    with ThreadPoolExecutor(8) as pool:
        outcomes = list(pool.map(submit, range(16)))
    admitted = [job for job in outcomes if job != "budget"]
    assert len(admitted) == 3 and outcomes.count("budget") == 13
    assert store.reserved("acme") == pytest.approx(0.9)
    assert store.active_count("acme") == 3 and store.redis.zcard(store.settings.key("tenant", "acme", "admitting")) == 0
    failed, canceled, done = admitted
    store.transition(failed, JobState.FAILED, 1, note="no region")  # ended unbilled: released
    store.transition(canceled, JobState.CANCELED, 0, note="tenant")
    assert store.reserved("acme") == pytest.approx(0.3)
    store.transition(done, JobState.LOCAL, 1)
    store.transition(done, JobState.DONE, 1)  # not billed yet: still reserved
    assert store.reserved("acme") == pytest.approx(0.3)
    with pytest.raises(AdmissionRefused, match="budget"):  # 0.3 reserved + 0.8 > 1.0
        store.create("acme", {}, quota, reserve_usd=0.8)
    assert not store.create("acme", {}, quota, reserve_usd=0.7).existing  # 0.3 + 0.7 fits exactly


def test_billing_settles_the_reservation_once(store: JobStore) -> None:
    from prfaas.control_plane.billing.spend import TenantSpend

    spend = TenantSpend(store.redis, store)
    quota = Quota(rps=1000, concurrency=1000, budget_usd=1.0)
    job = store.create("acme", {}, quota, reserve_usd=0.4).job_id
    store.transition(job, JobState.LOCAL, 1)
    store.transition(job, JobState.DONE, 1)
    with spend.settling(["acme"]) as lease:  # the ledger entry's $ replaces the prediction
        spend.settle([("acme", job, 0.25, dt.datetime.now(dt.UTC))], lease)
    assert (store.spend("acme"), store.reserved("acme")) == (pytest.approx(0.25), 0.0)
    assert spend.release("acme", [job]) == 0 and spend.reservations("acme") == {}
    later = store.create("acme", {}, quota, reserve_usd=0.75).job_id  # 0.25 spent + 0.75 fits
    with pytest.raises(AdmissionRefused, match="budget"):
        store.create("acme", {}, quota)  # no headroom left at all
    assert spend.reservations("acme") == {later: pytest.approx(0.75)}


def test_a_key_whose_job_was_canceled_as_its_client_left_gets_a_fresh_job(store: JobStore) -> None:
    """A retry after a dropped connection (the job canceled with CLIENT_LEFT) runs again; a job the tenant
    canceled, or one that failed, is still the key's answer; another body is still refused."""
    left = store.create("acme", {}, ROOMY, admission=store.admit("acme", ROOMY, idempotency_key="k", body_hash="a"))
    store.transition(left.job_id, JobState.CANCELED, 0, note="client disconnected", client_canceled=1, client_left=1)
    with pytest.raises(AdmissionRefused, match="idempotency"):
        store.admit("acme", ROOMY, idempotency_key="k", body_hash="b")
    retry = store.admit("acme", ROOMY, idempotency_key="k", body_hash="a")
    assert not retry.existing and retry.job_id != left.job_id
    fresh = store.create("acme", {}, ROOMY, admission=retry)
    assert (fresh.existing, fresh.job_id) == (False, retry.job_id)
    again = store.admit("acme", ROOMY, idempotency_key="k", body_hash="a")  # the key names the fresh job now
    assert (again.existing, again.job_id) == (True, fresh.job_id)
    for name, marked in (("tenant", {"client_canceled": 1, "client_left": 0}), ("failed", {})):
        first = store.create("acme", {}, ROOMY, idempotency_key=name).job_id
        if marked:
            store.transition(first, JobState.CANCELED, 0, note="canceled by the tenant", **marked)
        else:
            store.transition(first, JobState.FAILED, 1, error="boom")
        replay = store.admit("acme", ROOMY, idempotency_key=name)
        assert (replay.existing, replay.job_id) == (True, first), name


def test_idempotency_key_with_another_body_is_refused(store: JobStore) -> None:
    first = store.create("acme", {}, ROOMY, admission=store.admit("acme", ROOMY, idempotency_key="k", body_hash="a"))
    same = store.admit("acme", ROOMY, idempotency_key="k", body_hash="a")
    assert (same.existing, same.job_id) == (True, first.job_id)
    with pytest.raises(AdmissionRefused, match="idempotency"):
        store.admit("acme", ROOMY, idempotency_key="k", body_hash="b")
    # two requests with a new key race: both admitted before either wrote its job; the second to write loses
    quota = Quota(rps=1000, concurrency=2, budget_usd=10)
    racers = [store.admit("globex", quota, idempotency_key="r", body_hash=h) for h in ("x", "y")]
    won = store.create("globex", {}, quota, admission=racers[0])
    with pytest.raises(AdmissionRefused, match="idempotency"):
        store.create("globex", {}, quota, admission=racers[1])
    # the loser's slot was given back: one job active, one slot free
    assert not won.existing and store.admit("globex", quota).existing is False


def test_job_keys_expire_from_creation_and_the_index_is_trimmed(store: JobStore) -> None:
    index = store.settings.key("tenant", "acme", "jobs")
    keep_s = int(store.settings.job.timeout_s) + store.settings.job.ttl_s
    store.redis.zadd(index, {"long-gone": time.time() - keep_s - 1, "recent": time.time() - 10})
    job = store.create("acme", {}, ROOMY).job_id
    assert set(store.redis.zrange(index, 0, -1)) == {b"recent", job.encode()}  # trimmed in the creating script
    for key in (store.settings.key("job", job), store.settings.key("job", job) + ":timeline"):
        assert keep_s - 5 < store.redis.ttl(key) <= keep_s  # a job nobody ends still goes away
    second = store.create("acme", {}, ROOMY).job_id
    store.transition(job, JobState.CANCELED, 0)
    assert store.redis.ttl(store.settings.key("job", job)) <= store.settings.job.ttl_s  # the shorter TTL
    assert store.redis.ttl(index) > store.settings.job.ttl_s  # a live job still names it
    store.transition(second, JobState.CANCELED, 0)
    assert 0 < store.redis.ttl(index) <= store.settings.job.ttl_s  # the last live job ended: so may the index


def test_the_follow_is_written_with_the_job_and_ended_by_the_move_that_ends_it(store: JobStore) -> None:
    """CREATE writes the follower; DONE (with the last token logged, in the same script) or CANCELED
    drops it, but only for the process that follows the job; a move that does not end the job keeps it."""
    following = store.settings.key("following")
    done = store.create("acme", {}, ROOMY, follow_as="api:one").job_id
    assert store.redis.hget(following, done) == b"api:one"
    store.transition(done, JobState.LOCAL, 1, unfollow="api:one")  # not terminal: still followed
    assert store.redis.hget(following, done) == b"api:one"
    store.transition(done, JobState.DONE, 1, log_token='[7, 1, "length"]', unfollow="api:other")
    assert store.redis.hget(following, done) == b"api:one"  # another process's DONE leaves our follow be
    assert store.redis.lrange(store.settings.key("job", done) + ":tokens", 0, -1) == [b'[7, 1, "length"]']

    canceled = store.create("acme", {}, ROOMY, follow_as="api:one").job_id
    with pytest.raises(IllegalTransition):  # refused: the token is not logged, the follow kept
        store.transition(canceled, JobState.DONE, 1, log_token="[1]", unfollow="api:one")
    assert store.redis.hget(following, canceled) == b"api:one"
    assert store.redis.llen(store.settings.key("job", canceled) + ":tokens") == 0
    store.transition(canceled, JobState.CANCELED, 0, unfollow="api:one")
    assert store.redis.hget(following, canceled) is None
    assert store.create("acme", {}, ROOMY).job_id.encode() not in store.redis.hkeys(following)  # no follower: none
