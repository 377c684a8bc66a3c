"""Races between the processes that move a job's attempts (real Redis, real gRPC): two callers failing
one attempt, a sweeper adopting a job whose attempt another process moved on meanwhile, and a follower
whose DONE a newer attempt refused. The decode region here is a test servicer whose calls are where the
other process acts, so each race happens at the one moment that matters, every run."""

from __future__ import annotations

import base64
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest
from cp_kit import cleanup, ensure_redis, make_settings

from prfaas.control_plane.jobs.attempts import Attempts
from prfaas.control_plane.jobs.celery_app import make_celery
from prfaas.control_plane.jobs.generation import Follower
from prfaas.control_plane.jobs.leases import Heartbeats, Leases
from prfaas.control_plane.jobs.states import JobState
from prfaas.control_plane.jobs.sweeper import Sweeper
from prfaas.control_plane.services import Services
from prfaas.control_plane.tenants import Quota
from prfaas.engine.sampling import SamplingParams
from prfaas.protos.prfaas.v1 import common_pb2, decode_pb2, decode_pb2_grpc
from prfaas.region.channels import ChannelCache

QUOTA = Quota(rps=1000, concurrency=100, budget_usd=100.0)
TOKENS = [101, 102, 103]


@pytest.fixture
def services() -> Iterator[Services]:
    ensure_redis()
    settings = make_settings()
    services = Services.create(settings)
    yield services
    services.close()
    cleanup(settings)


def _attempts(services: Services, owner: str, queued: list[str] | None = None) -> Attempts:
    leases = Leases(services.redis, services.settings)
    return Attempts(services.jobs, leases, lambda job_id, _countdown: (queued or []).append(job_id), owner)


def _job(services: Services, **fields: Any) -> str:
    sampling = SamplingParams(max_new_tokens=len(TOKENS), ignore_eos=True).to_dict()
    record = {"token_ids": [1, 2, 3], "prompt_tokens": 3, "max_new_tokens": len(TOKENS), "sampling": sampling}
    created = services.jobs.create("t-" + uuid.uuid4().hex[:8], record | fields, QUOTA, reserve_usd=1.0)
    return created.job_id


class Decode(decode_pb2_grpc.DecodeRegionServicer):
    """Streams TOKENS for any attempt; `on_cancel` / `before_last` run inside Cancel and before attempt 1's
    last token: where the other process's move lands."""

    def __init__(self) -> None:
        self.on_cancel: Callable[[], None] = lambda: None
        self.before_last: Callable[[], None] = lambda: None
        self.attempts: list[int] = []

    def Cancel(self, request: common_pb2.CancelRequest, context: Any) -> common_pb2.CancelReply:  # noqa: N802
        self.on_cancel()
        return common_pb2.CancelReply(found=True)

    def Decode(self, request: decode_pb2.DecodeRequest, context: Any) -> Iterator[decode_pb2.TokenEvent]:  # noqa: N802
        self.attempts.append(request.attempt)
        for index, token in enumerate(TOKENS):
            last = index == len(TOKENS) - 1
            if last and request.attempt == 1:
                self.before_last()
            yield decode_pb2.TokenEvent(index=index, token=token, last=last, finish_reason="length" if last else "")


@pytest.fixture
def decode() -> Iterator[tuple[Decode, str]]:
    servicer = Decode()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    decode_pb2_grpc.add_DecodeRegionServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, f"127.0.0.1:{port}"
    server.stop(None)


def _hand_off(services: Services, job_id: str, attempt: int, target: str) -> None:
    """What a dispatch of `attempt` does up to its hand-off to the follower."""
    services.jobs.transition(job_id, JobState.PREFILLING, attempt)
    services.jobs.transition(job_id, JobState.TRANSFERRING, attempt)
    kv = base64.b64encode(common_pb2.KVDescriptor(num_tokens=3).SerializeToString()).decode()
    services.jobs.post_ready(job_id, attempt, {"mode": "split", "decode_grpc": target, "decode_region": "d",
                                               "kv": kv, "first_token": TOKENS[0]})  # fmt: skip


def test_the_loser_of_two_fails_of_one_attempt_leaves_the_next_attempt_its_lease(services: Services) -> None:
    job_id = _job(services)
    services.jobs.transition(job_id, JobState.PREFILLING, 1)
    first, second = _attempts(services, "worker:a"), _attempts(services, "worker:b")
    assert first.fail(job_id, 1, "", "prefill lost") == "retrying"
    assert second.fail(job_id, 1, "", "prefill lease overran") == "superseded"
    job, lease = services.jobs.get(job_id), first.leases.get(job_id)
    assert (job["state"], job["attempt"]) == (JobState.QUEUED, "2")
    assert lease is not None and (lease.attempt, lease.stage) == (2, "queued")  # the sweeper still guards it


def test_a_sweeper_adopts_an_orphan_whose_attempt_another_process_moved_on(
    services: Services, decode: tuple[Decode, str]
) -> None:
    """The API process following an Idempotency-Key job died; while the sweeper stops its decode, another
    process (a sweeper recovering the dead host's worker lease) fails the same attempt: the sweeper still
    adopts the job, so the next attempt has a follower."""
    servicer, target = decode
    job_id = _job(services, idempotent=1)
    _hand_off(services, job_id, 1, target)
    services.jobs.update(job_id, 1, decode_grpc=target, decode_region="d")
    leases = Leases(services.redis, services.settings)
    leases.follow(job_id, "api:dead")
    beats = {"api": Heartbeats(services.redis, services.settings, "api"),
             "worker": Heartbeats(services.redis, services.settings, "worker")}  # fmt: skip
    services.redis.zadd(services.settings.key("beats", "api"), {"api:dead": time.time() - 3600 + 60})
    other = _attempts(services, "worker:other")
    servicer.on_cancel = lambda: other.fail(job_id, 1, "", "the dead host's worker lease")
    adopted: list[tuple[str, int]] = []
    sweeper = Sweeper(services.jobs, leases, _attempts(services, "worker:sweeper"), beats, ChannelCache(None),
                      adopt=lambda job, after: adopted.append((job, after)))  # fmt: skip
    done = sweeper.sweep()
    assert adopted == [(job_id, 1)], done  # follows the hand-off of attempt 2 on
    assert services.jobs.get(job_id)["attempt"] == "2"


def test_a_follower_whose_done_a_newer_attempt_refused_sends_the_last_token_from_that_attempt(
    services: Services, decode: tuple[Decode, str]
) -> None:
    """Attempt 1's last token arrives just after a sweeper queued attempt 2 (a lease overran): DONE at
    attempt 1 is refused, so that token was not sent; attempt 2 streams the same tokens, and its last one
    is sent and ends the job DONE, once."""
    servicer, target = decode
    job_id = _job(services)
    _hand_off(services, job_id, 1, target)
    sweeper = _attempts(services, "worker:sweeper")

    def sweeper_moves_on() -> None:
        assert sweeper.fail(job_id, 1, "", "prefill lease overran") == "retrying"
        _hand_off(services, job_id, 2, target)

    servicer.before_last = sweeper_moves_on
    celery = make_celery(services.settings)
    try:
        tokens = [(t.index, t.token) for t in Follower(services, celery).tokens(job_id)]
    finally:
        celery.close()
    assert tokens == list(enumerate(TOKENS))
    job = services.jobs.get(job_id)
    assert (job["state"], job["attempt"]) == (JobState.DONE, "2") and servicer.attempts == [1, 2]
