"""The end of an API process's drain (`Follower.end_all`, api/shutdown.py) on real Redis and the real follower:
every job it streams ends as SHUTTING_DOWN, marked `client_left` (its Idempotency-Key gets a fresh job at the
next API process), a batch's prompts too, though the request's own reaction to its first canceled prompt
(sse.py: `cancel_batch`) races the drain's loop; and a job handed off after the drain ended never starts its
decode call (which could outrun the regions' Cancel and stream the whole answer for a CANCELED job)."""

from __future__ import annotations

import socket
import threading
import time
import uuid
from collections.abc import Iterator

import pytest
from cp_kit import settings_fixture

from prfaas.control_plane.api.sse import PromptJob, cancel_batch
from prfaas.control_plane.api.streams import merged
from prfaas.control_plane.jobs.errors import JobEnded
from prfaas.control_plane.jobs.generation import Follower
from prfaas.control_plane.jobs.store import SHUTTING_DOWN
from prfaas.control_plane.services import Services
from prfaas.control_plane.tenants import Quota
from prfaas.devstack.processes import wait_until
from prfaas.engine.sampling import SamplingParams

QUOTA = Quota(rps=1000, concurrency=1000, budget_usd=100)
PROMPTS = 16


@pytest.fixture
def services() -> Iterator[Services]:
    for settings in settings_fixture():
        s = Services.create(settings)
        yield s
        s.close()


def _job(s: Services, tenant: str) -> str:
    sampling = SamplingParams(max_new_tokens=8, ignore_eos=True).to_dict()
    fields = {"token_ids": [1, 2], "prompt_tokens": 2, "max_new_tokens": 8, "sampling": sampling, "idempotent": 1}
    return s.jobs.create(tenant, fields, QUOTA).job_id


def test_every_prompt_of_a_batch_ends_as_shutting_down_and_marked_for_a_fresh_retry(services: Services) -> None:
    follower = Follower(services, None)
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    ids = [_job(services, tenant) for _ in range(PROMPTS)]
    jobs = [PromptJob(i, follower.tokens(i, None, None), 2, [], leader=True) for i in ids]
    ended = threading.Event()

    def request() -> None:  # sse.py's loop over a batch, and its reaction to a prompt that ended
        try:
            for _ in merged([job.stream for job in jobs]):
                pass
        except JobEnded:
            cancel_batch(follower, jobs, "another prompt of the request failed")
        ended.set()

    threading.Thread(target=request, daemon=True).start()
    wait_until(lambda: follower.streaming() == PROMPTS, 10, 0.01)  # every prompt waits for its dispatch
    follower.end_all()
    assert ended.wait(10)
    records = [services.jobs.get(i) for i in ids]
    assert {(r["state"], r.get("error"), r.get("client_left")) for r in records} == {
        ("CANCELED", f"canceled: {SHUTTING_DOWN}", "1")
    }, [(r.get("error"), r.get("client_left")) for r in records]


def test_a_job_handed_off_after_the_drain_ended_is_canceled_before_any_decode_call(services: Services) -> None:
    follower = Follower(services, None)
    follower.end_all()  # the drain is over; a request admitted just before it reads its job now
    job_id = _job(services, f"t-{uuid.uuid4().hex[:8]}")
    with socket.socket() as region:  # the decode endpoint of the hand-off: a decode call would connect to it
        region.bind(("127.0.0.1", 0))
        region.listen(8)
        region.setblocking(False)
        ready = {"attempt": 1, "mode": "local", "decode_grpc": f"127.0.0.1:{region.getsockname()[1]}",
                 "decode_region": "d"}  # fmt: skip
        with pytest.raises(JobEnded) as info:
            next(follower.tokens(job_id, services.jobs.get(job_id), ready))
        time.sleep(0.2)
        with pytest.raises(BlockingIOError):  # no decode call came
            region.accept()
    assert (info.value.state, str(info.value)) == ("CANCELED", f"canceled: {SHUTTING_DOWN}")
    record = services.jobs.get(job_id)
    assert (record["state"], record.get("client_left")) == ("CANCELED", "1")
    assert follower.streaming() == 0
