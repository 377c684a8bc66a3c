"""Requests attached to a running job by its Idempotency-Key (real Redis): they read its token log, each token once,
and they hold the job only while their process lives. An attached reader counts `reader_s` (10 x `dead_after_s`,
here 1 s) after it last renewed its entry, so one whose API process died no longer keeps a job running for nobody."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator

import pytest
from cp_kit import cleanup, ensure_redis, make_settings

from prfaas.control_plane.jobs.generation import Follower
from prfaas.control_plane.jobs.states import JobState
from prfaas.control_plane.jobs.tokenlog import Token, TokenLog
from prfaas.control_plane.services import Services
from prfaas.control_plane.tenants import Quota
from prfaas.devstack.processes import wait_until
from prfaas.engine.sampling import SamplingParams

QUOTA = Quota(rps=1000, concurrency=100, budget_usd=100.0)
TOKENS = [101, 102, 103]


@pytest.fixture
def services() -> Iterator[Services]:
    ensure_redis()
    settings = make_settings(dead_after_s=0.1, beat_s=0.05)
    services = Services.create(settings)
    yield services
    services.close()
    cleanup(settings)


def _running(services: Services, logged: int = 1) -> str:
    """A job decoding locally (attempt 1) whose first `logged` tokens are in its log."""
    sampling = SamplingParams(max_new_tokens=len(TOKENS), ignore_eos=True).to_dict()
    record = {"token_ids": [1, 2, 3], "prompt_tokens": 3, "max_new_tokens": len(TOKENS), "sampling": sampling}
    job_id = services.jobs.create("t-" + uuid.uuid4().hex[:8], record, QUOTA).job_id
    services.jobs.transition(job_id, JobState.LOCAL, 1)
    for index in range(logged):
        TokenLog(services.jobs).log_token(job_id, Token(index, TOKENS[index], False, ""))
    return job_id


def test_an_attached_reader_gets_a_token_logged_twice_once(services: Services) -> None:
    """Two followers logged the same token (an API process declared dead while it still streamed, and the worker
    that adopted its job): a request attached to the job reads each token once (before, it got that one twice)."""
    job_id = _running(services, logged=2)
    log = TokenLog(services.jobs)
    log.log_token(job_id, Token(1, TOKENS[1], False, ""))
    services.jobs.transition(job_id, JobState.DONE, 1, log_token=Token(2, TOKENS[2], True, "length").entry())
    tokens = [(t.index, t.token) for t in Follower(services, None).attached(job_id)]
    assert tokens == list(enumerate(TOKENS))


def test_a_request_attached_but_not_yet_read_holds_the_job(services: Services) -> None:
    """An Idempotency-Key retry attached to the job (admitted, its response not yet read) when the job's own
    client leaves: the job runs on for it (before, the reader counted from its first read only, and the job was
    canceled under the retry, which then got `job_canceled`). A retry that leaves before reading stops counting
    at once, and the job's own client leaving then cancels it."""
    job_id = _running(services)
    log = TokenLog(services.jobs)
    retry = Follower(services, None, owner="api:retry").attached(job_id)
    own = Follower(services, None, owner="api:own")
    assert log.readers(job_id) == 1 and not own.left(job_id)
    assert next(retry).token == TOKENS[0] and services.jobs.get(job_id)["state"] == JobState.LOCAL
    retry.close()
    gone = Follower(services, None, owner="api:gone").attached(job_id)
    gone.close()  # its client left before its first chunk
    assert log.readers(job_id) == 0 and own.left(job_id)
    assert services.jobs.get(job_id)["state"] == JobState.CANCELED


def test_a_process_that_resumes_after_its_job_was_adopted_reads_the_adopters_log(services: Services) -> None:
    """An API process paused past `dead_after_s` (its job adopted by a worker, attempt 2 handed off) resumes:
    it sends its client the tokens the adopter logs, those it had not sent, and calls no decode region of its
    own (before, it called the decode region for attempt 2 beside the adopter, the region canceled one of the
    two calls, and that CANCELLED excluded the only decode instance: the job failed)."""
    job_id = _running(services)
    paused = Follower(services, None, owner="api:paused")
    paused.leases.follow(job_id, "api:paused")
    sent = [Token(0, TOKENS[0], False, "")]  # what its client got before the pause
    services.jobs.transition(job_id, JobState.QUEUED, 2, note="adopted")
    stream = paused.tokens(job_id, after_attempt=1, already=sent, followed=True)
    got: list[int] = []
    thread = threading.Thread(target=lambda: got.extend(t.token for t in stream), daemon=True)
    thread.start()
    paused.leases.follow(job_id, "worker:adopter")  # the sweeper's adoption
    services.jobs.post_ready(job_id, 2, {"mode": "local", "decode_grpc": "127.0.0.1:1", "decode_region": "nowhere"})
    log = TokenLog(services.jobs)
    wait_until(lambda: log.readers(job_id) == 1, 5)  # reading the log, not calling 127.0.0.1:1
    services.jobs.transition(job_id, JobState.LOCAL, 2)
    log.log_token(job_id, Token(1, TOKENS[1], False, ""))
    services.jobs.transition(job_id, JobState.DONE, 2, log_token=Token(2, TOKENS[2], True, "length").entry())
    thread.join(10)
    assert got == TOKENS[1:] and services.jobs.get(job_id)["state"] == JobState.DONE
    assert log.readers(job_id) == 0


def test_a_reader_whose_process_died_no_longer_holds_the_job(services: Services) -> None:
    """The attached request's API process dies (its reader never ends), then the job's own client leaves: the job
    is canceled once that reader stopped counting (before, the readers counter kept its +1 for good, and the job
    ran to its end for nobody, every time its own client left)."""
    job_id = _running(services)
    reader = Follower(services, None, owner="api:dies").attached(job_id)
    assert next(reader).token == TOKENS[0]  # attached; its process dies here: `reader` is never read again
    own = Follower(services, None, owner="api:own")
    assert not own.left(job_id)  # it still counts: the job runs on for it
    try:
        wait_until(lambda: own.left(job_id), 5)
        assert services.jobs.get(job_id)["state"] == JobState.CANCELED
    finally:
        reader.close()


def test_a_live_reader_holds_the_job_while_it_waits(services: Services) -> None:
    """A reader waiting for the next token (a slow decode) renews its entry: the job's own client leaving then
    cancels nothing, well past `reader_s`; once the reader ends, it no longer counts."""
    job_id = _running(services)
    log = TokenLog(services.jobs)
    reader = Follower(services, None, owner="api:reads").attached(job_id)
    read: list[int] = []
    thread = threading.Thread(target=lambda: read.extend(t.token for t in reader), daemon=True)
    thread.start()
    wait_until(lambda: read == TOKENS[:1], 5)
    time.sleep(1.5 * log.reader_s)  # no token meanwhile: only its renewals keep it counted
    own = Follower(services, None, owner="api:own")
    assert not own.left(job_id) and log.readers(job_id) == 1
    log.log_token(job_id, Token(1, TOKENS[1], False, ""))
    services.jobs.transition(job_id, JobState.DONE, 1, log_token=Token(2, TOKENS[2], True, "length").entry())
    thread.join(5)
    assert read == TOKENS and log.readers(job_id) == 0


def test_a_job_read_on_for_a_reader_is_canceled_once_that_reader_died(services: Services) -> None:
    """The job's own client left while a reader counted: its stream is read on for that reader, and the job is
    canceled once the reader stops counting (its process died), not decoded to its end for nobody."""
    job_id = _running(services)
    reader = Follower(services, None, owner="api:dies").attached(job_id)
    assert next(reader).token == TOKENS[0]
    ended = threading.Event()

    def decoding() -> Iterator[Token]:  # the job's own stream: a long decode, a token every 20 ms
        try:
            for index in range(1, 1000):
                time.sleep(0.02)
                yield Token(index, 7, False, "")
        finally:
            ended.set()

    try:
        Follower(services, None, owner="api:own").disconnected(job_id, decoding())
        wait_until(ended.is_set, 5)
        assert services.jobs.get(job_id)["state"] == JobState.CANCELED
    finally:
        reader.close()
