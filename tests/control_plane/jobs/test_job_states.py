"""The job state machine's table (control_plane/jobs/states.py) against the transition script on the real
Redis: every (from, to) pair of states, legal or not, is tried on a job brought to `from` by legal moves.
The script must accept exactly the moves of `EXPECTED_MOVES` and refuse every other one, changing nothing.

`EXPECTED_MOVES` is written out here, by hand, from docs (DESIGN.md "Job states") rather than read from
states.py: the script is generated from `LEGAL_MOVES`, so a test deriving its expectations from that table
too would pass whatever the table said."""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterator

import pytest
import redis
from cp_kit import settings_fixture

from prfaas.control_plane.jobs.errors import IllegalTransition
from prfaas.control_plane.jobs.states import LEGAL_MOVES, TERMINAL, JobState, is_legal
from prfaas.control_plane.jobs.store import JobStore
from prfaas.control_plane.settings import Settings
from prfaas.control_plane.tenants import Quota

ROOMY = Quota(rps=1e6, concurrency=1_000_000, budget_usd=1e9)
PAIRS = list(itertools.product(JobState, JobState))

Q, P, T, D, L = JobState.QUEUED, JobState.PREFILLING, JobState.TRANSFERRING, JobState.DECODING, JobState.LOCAL
DONE, FAILED, CANCELED = JobState.DONE, JobState.FAILED, JobState.CANCELED
# Every live state may give up (FAILED), be canceled (CANCELED) or start its next attempt (QUEUED).
EXPECTED_MOVES: dict[JobState, frozenset[JobState]] = {
    # split (prefill here, decode there) or local (the decode region does it all)
    Q: frozenset({P, L, FAILED, CANCELED, Q}),
    P: frozenset({T, FAILED, CANCELED, Q}),  # prefill done: ship the KV
    T: frozenset({D, FAILED, CANCELED, Q}),  # KV landed: decode
    D: frozenset({DONE, FAILED, CANCELED, Q}),
    L: frozenset({DONE, FAILED, CANCELED, Q}),
    DONE: frozenset(),  # terminal: nothing leaves it
    FAILED: frozenset(),
    CANCELED: frozenset(),
}


def path_to(target: JobState) -> list[JobState]:
    """The shortest chain of expected moves from QUEUED (where a job is created) to `target`."""
    parents: dict[JobState, JobState | None] = {JobState.QUEUED: None}
    todo = deque([JobState.QUEUED])
    while todo:
        state = todo.popleft()
        for nxt in sorted(EXPECTED_MOVES[state]):
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


def test_the_table_is_the_documented_lifecycle() -> None:
    assert {s: LEGAL_MOVES.get(s, frozenset()) for s in JobState} == EXPECTED_MOVES
    assert {s: {t for t in JobState if is_legal(s, t)} for s in JobState} == EXPECTED_MOVES
    assert {DONE, FAILED, CANCELED} == TERMINAL
    assert set(LEGAL_MOVES) == {Q, P, T, D, L}  # terminal states have no row at all


def test_every_state_is_reachable() -> None:
    assert path_to(D) == [P, T, D]  # the split path
    assert path_to(DONE) == [L, DONE]  # the local path is the shortest
    assert path_to(L) == [L]
    assert all(path_to(s)[-1] == s for s in set(JobState) - {Q})


@pytest.mark.parametrize(("current", "target"), PAIRS, ids=[f"{a.value}->{b.value}" for a, b in PAIRS])
def test_move(store: JobStore, current: JobState, target: JobState) -> None:
    job = store.create("acme", {}, ROOMY).job_id
    attempt = 1
    for state in path_to(current):
        attempt = store.transition(job, state, attempt + 1 if state is JobState.QUEUED else attempt)
    assert store.get(job)["state"] == current
    given = attempt + 1 if target is JobState.QUEUED else attempt  # a retry names the next attempt
    before = (store.get(job), store.timeline(job))
    if target in EXPECTED_MOVES[current]:
        assert store.transition(job, target, given) == given
        assert store.get(job)["state"] == target and store.timeline(job)[-1]["state"] == target
    else:
        with pytest.raises(IllegalTransition):
            store.transition(job, target, given)
        assert (store.get(job), store.timeline(job)) == before  # a refused move changes nothing
