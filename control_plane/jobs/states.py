"""The job state machine: its states and its table of legal moves, written once, here. The job store's
transition script (jobs/scripts.py) is generated from `LEGAL_MOVES`, so Redis refuses exactly what this
table leaves out; tests/control_plane/jobs/test_job_states.py walks every pair against a real Redis.

    QUEUED -> PREFILLING -> TRANSFERRING -> DECODING -> DONE     (split: prefill here, decode there)
    QUEUED -> LOCAL -> DONE                                       (the decode region does it all)
    any live state -> FAILED | CANCELED | QUEUED                  (QUEUED: the next attempt)

A move to QUEUED starts a new attempt (the attempt given must be the current one + 1); every other move
carries the current attempt (CANCELED also takes attempt 0: the tenant's cancel, whatever the attempt).
DONE, FAILED and CANCELED are terminal: nothing leaves them."""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum


class JobState(StrEnum):
    QUEUED = "QUEUED"
    PREFILLING = "PREFILLING"
    TRANSFERRING = "TRANSFERRING"
    DECODING = "DECODING"
    LOCAL = "LOCAL"
    DONE = "DONE"
    FAILED = "FAILED"
    CANCELED = "CANCELED"


TERMINAL = frozenset({JobState.DONE, JobState.FAILED, JobState.CANCELED})
# Where each live state goes next when its work succeeds.
FORWARD: Mapping[JobState, frozenset[JobState]] = {
    JobState.QUEUED: frozenset({JobState.PREFILLING, JobState.LOCAL}),
    JobState.PREFILLING: frozenset({JobState.TRANSFERRING}),
    JobState.TRANSFERRING: frozenset({JobState.DECODING}),
    JobState.DECODING: frozenset({JobState.DONE}),
    JobState.LOCAL: frozenset({JobState.DONE}),
}
# Where any live state may go whatever its work did: give up, be canceled, or start the next attempt.
ANY_TIME = frozenset({JobState.FAILED, JobState.CANCELED, JobState.QUEUED})
# The table: state -> the states it may move to. Terminal states have no entry.
LEGAL_MOVES: Mapping[JobState, frozenset[JobState]] = {state: nexts | ANY_TIME for state, nexts in FORWARD.items()}


def is_legal(current: JobState, target: JobState) -> bool:
    return target in LEGAL_MOVES.get(current, frozenset())
