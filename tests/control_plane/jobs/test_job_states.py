"""The job state machine's table (control_plane/jobs/states.py) against the transition script on the real
Redis: every (from, to) pair of states, legal or not, is tried on a job brought to `from` by legal moves.
The script must accept exactly the table's moves and refuse every other one, changing nothing."""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterator

import pytest
import redis
from cp_kit import settings_fixture

from prfaas.control_plane.jobs.errors import IllegalTransition
from prfaas.control_plane.jobs.scripts import TRANSITION, lua_legal_table
from prfaas.control_plane.jobs.states import LEGAL_MOVES, TERMINAL, JobState, is_legal
from prfaas.control_plane.jobs.store import JobStore
from prfaas.control_plane.settings import Settings
from prfaas.control_plane.tenants import Quota

ROOMY = Quota(rps=1e6, concurrency=1_000_000, budget_usd=1e9)
PAIRS = list(itertools.product(JobState, JobState))


def path_to(target: JobState) -> list[JobState]:
    """The shortest chain of legal moves from QUEUED (where a job is created) to `target`."""
    parents: dict[JobState, JobState | None] = {JobState.QUEUED: None}
    todo = deque([JobState.QUEUED])
    while todo:
        state = todo.popleft()
        for nxt in sorted(LEGAL_MOVES.get(state, ())):
            if nxt not in parents:
                parents[nxt] = state
                todo.append(nxt)
    path: list[JobState] = []
    at: JobState | None = target
    while at is not None and at is not JobState.QUEUED:
        path.append(at)
        at = parents[at]
    return path[::-1]


@pytest.fixture(scope="module")
def store() -> Iterator[JobStore]:
    settings: Settings
    for settings in settings_fixture(job={"ttl_s": 60}):
        client = redis.Redis.from_url(settings.redis_url)
        yield JobStore(client, settings)
        client.close()


def test_every_state_is_reachable_and_terminal_states_have_no_moves() -> None:
    assert all(path_to(s)[-1:] in ([s], []) for s in JobState)  # [] only for QUEUED itself
    assert set(LEGAL_MOVES) == set(JobState) - TERMINAL
    assert all(not is_legal(t, s) for t in TERMINAL for s in JobState)


def test_the_script_holds_the_table() -> None:
    assert lua_legal_table(LEGAL_MOVES) in TRANSITION
    assert "local legal = {\n  QUEUED = {CANCELED=1, FAILED=1, LOCAL=1, PREFILLING=1, QUEUED=1},\n" in TRANSITION


@pytest.mark.parametrize(("current", "target"), PAIRS, ids=[f"{a.value}->{b.value}" for a, b in PAIRS])
def test_move(store: JobStore, current: JobState, target: JobState) -> None:
    job = store.create("acme", {}, ROOMY).job_id
    attempt = 1
    for state in path_to(current):
        attempt = store.transition(job, state, attempt + 1 if state is JobState.QUEUED else attempt)
    assert store.get(job)["state"] == current
    given = attempt + 1 if target is JobState.QUEUED else attempt  # a retry names the next attempt
    before = (store.get(job), store.timeline(job))
    if is_legal(current, target):
        assert store.transition(job, target, given) == given
        assert store.get(job)["state"] == target and store.timeline(job)[-1]["state"] == target
    else:
        with pytest.raises(IllegalTransition):
            store.transition(job, target, given)
        assert (store.get(job), store.timeline(job)) == before  # a refused move changes nothing
