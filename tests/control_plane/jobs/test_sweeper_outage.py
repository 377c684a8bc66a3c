"""The sweeper across a Redis outage (real Redis): while Redis is away no process can beat, so when it comes
back every live worker's and API process's last beat is older than `dead_after_s`. A sweeper pass then must
not take their leases (a live prefill canceled and retried) nor fail the jobs they follow: after a gap in
its own passes, the sweeper declares no one dead until each has had `dead_after_s` to beat again. The outage
is what the sweeper sees of one: no beat and no pass for 2 s."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Iterator

import pytest
from cp_kit import cleanup, ensure_redis, make_settings

from prfaas.control_plane.jobs.attempts import Attempts
from prfaas.control_plane.jobs.leases import Heartbeats, Lease, Leases
from prfaas.control_plane.jobs.states import JobState
from prfaas.control_plane.jobs.sweeper import Sweeper
from prfaas.control_plane.services import Services
from prfaas.control_plane.tenants import Quota
from prfaas.region.channels import ChannelCache

DEAD_AFTER_S = 1.0


@pytest.fixture
def services() -> Iterator[Services]:
    ensure_redis()
    settings = make_settings(dead_after_s=DEAD_AFTER_S, sweep_s=0.2, beat_s=0.2)
    services = Services.create(settings)
    yield services
    services.close()
    cleanup(settings)


def _prefilling(services: Services, leases: Leases, owner: str) -> str:
    """A job whose attempt 1 is prefilling under `owner`'s lease."""
    fields = {"token_ids": [1, 2, 3], "prompt_tokens": 3, "max_new_tokens": 2}
    quota = Quota(rps=100, concurrency=100, budget_usd=100)
    job_id = services.jobs.create("t-" + uuid.uuid4().hex[:8], fields, quota).job_id
    services.jobs.transition(job_id, JobState.PREFILLING, 1, note="prefill")
    leases.grant(Lease(job_id, 1, "prefill", owner, "prefill-a/i0", time.time() + 60))
    return job_id


def test_after_an_outage_no_one_is_dead_until_they_could_beat_again(services: Services) -> None:
    leases = Leases(services.redis, services.settings)
    beats = {"worker": Heartbeats(services.redis, services.settings, "worker")}
    attempts = Attempts(services.jobs, leases, lambda *_: None, "worker:sweeper")
    sweeper = Sweeper(services.jobs, leases, attempts, beats, ChannelCache(None))
    key = services.settings.key("beats", "worker")

    def beat(owner: str) -> None:
        services.redis.zadd(key, {owner: time.time()})

    live, dead = _prefilling(services, leases, "worker:live"), _prefilling(services, leases, "worker:dead")
    beat("worker:live")
    beat("worker:dead")
    assert sweeper.sweep() == []
    time.sleep(2.0)  # Redis away: no beat lands, no pass runs

    assert sweeper.sweep() == []  # both beats are 2 s old: neither is declared dead yet
    assert leases.get(live) is not None and leases.get(dead) is not None
    beat("worker:live")  # the live worker beats again once Redis is back; the dead one never does
    time.sleep(DEAD_AFTER_S + 0.1)
    beat("worker:live")
    done = sweeper.sweep()
    assert len(done) == 1 and done[0].startswith(f"{dead}: retrying"), done
    assert leases.get(live) is not None and services.jobs.get(live)["state"] == JobState.PREFILLING


def test_a_process_whose_host_clock_lags_is_alive_while_it_beats(
    services: Services, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An API host whose clock is 2 x `dead_after_s` behind the sweeper's: its beats are stamped on Redis's clock,
    so it is alive and the job it follows is left alone (before, its beats were stamped with its own clock, and
    the sweeper failed every job it followed while it beat)."""
    api = Heartbeats(services.redis, services.settings, "api")
    leases = Leases(services.redis, services.settings)
    beats = {"api": api, "worker": Heartbeats(services.redis, services.settings, "worker")}
    sweeper = Sweeper(services.jobs, leases, Attempts(services.jobs, leases, lambda *_: None, "worker:sweeper"),
                      beats, ChannelCache(None))  # fmt: skip
    quota = Quota(rps=100, concurrency=100, budget_usd=100)
    job_id = services.jobs.create("t-" + uuid.uuid4().hex[:8], {"token_ids": [1]}, quota, follow_as=api.me).job_id
    with monkeypatch.context() as lagging:
        now = time.time
        lagging.setattr(time, "time", lambda: now() - 2 * DEAD_AFTER_S)  # the API host's clock
        api.beat()
    assert api.me in api.alive()
    assert sweeper.sweep() == [] and services.jobs.get(job_id)["state"] == JobState.QUEUED
    sweeper.stop()


@pytest.mark.parametrize("skew_s", [60.0, -60.0])
def test_lease_deadlines_are_on_redis_clock_whatever_the_hosts_clocks(
    services: Services, monkeypatch: pytest.MonkeyPatch, skew_s: float
) -> None:
    """A worker whose host clock is `skew_s` behind the sweeper's grants a 30 s prefill lease: the sweeper takes it
    back neither while it runs (before, a sweeper 60 s ahead retried every stage under a minute) nor later than
    its deadline when it is behind."""
    real = time.time

    @contextlib.contextmanager
    def host(clock_skew_s: float) -> Iterator[None]:
        with monkeypatch.context() as clock:
            clock.setattr(time, "time", lambda: real() + clock_skew_s)
            yield

    owner = Heartbeats(services.redis, services.settings, "worker").start()
    with host(-skew_s / 2):  # the granting worker's host
        granting = Leases(services.redis, services.settings)
        job_id = _prefilling_for(services, granting, owner.me, 30.0)
    with host(skew_s / 2):  # the sweeper's host
        leases = Leases(services.redis, services.settings)
        sweeper = Sweeper(services.jobs, leases, Attempts(services.jobs, leases, lambda *_: None, "worker:sweeper"),
                          {"worker": owner}, ChannelCache(None))  # fmt: skip
        assert sweeper.sweep() == [] and leases.get(job_id) is not None  # 30 s left on Redis's clock
    with host(-skew_s / 2):
        granting.grant(Lease(job_id, 1, "prefill", owner.me, "prefill-a/i0", granting.clock.now() - 0.5))  # overran
    with host(skew_s / 2):
        done = sweeper.sweep()
    assert len(done) == 1 and done[0].startswith(f"{job_id}: retrying"), done
    owner.stop()


def _prefilling_for(services: Services, leases: Leases, owner: str, lease_s: float) -> str:
    fields = {"token_ids": [1, 2, 3], "prompt_tokens": 3, "max_new_tokens": 2}
    quota = Quota(rps=100, concurrency=100, budget_usd=100)
    job_id = services.jobs.create("t-" + uuid.uuid4().hex[:8], fields, quota).job_id
    services.jobs.transition(job_id, JobState.PREFILLING, 1, note="prefill")
    leases.grant(Lease(job_id, 1, "prefill", owner, "prefill-a/i0", leases.clock.now() + lease_s))
    return job_id
