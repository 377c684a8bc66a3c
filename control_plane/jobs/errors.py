"""Typed errors of the job store (jobs/store.py). The HTTP layer maps `JobNotFound` to 404 and
`AdmissionRefused` to 402 / 422 / 429 by its `reason`; the dispatcher and the API treat `IllegalTransition` and
`StaleAttempt` as "someone else moved the job on" and stop following it."""

from __future__ import annotations


class JobStoreError(Exception):
    """Base of the job store's typed errors."""


class JobNotFound(JobStoreError):
    pass


class IllegalTransition(JobStoreError):
    """The move is not in `states.LEGAL_MOVES` from the job's current state."""

    def __init__(self, job_id: str, current: str, target: str) -> None:
        super().__init__(f"job {job_id}: {current} -> {target} is not a legal transition")
        self.current = current


class StaleAttempt(JobStoreError):
    """The move names an attempt other than the job's current one (QUEUED: other than current + 1)."""

    def __init__(self, job_id: str, current: int, given: int) -> None:
        super().__init__(f"job {job_id}: attempt {given} is stale (current attempt {current})")
        self.current = current


class AdmissionRefused(JobStoreError):
    """`reason`: `rate`, `concurrency`, `budget` (no headroom, or the job's reservation does not fit) or
    `idempotency` (the Idempotency-Key was used with another body)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


STORE_LOST = "job store unreachable mid-job: its result is unknown; retry (with an Idempotency-Key the retry is safe)"
RECORD_LOST = "job store unreachable mid-job: it came back without the job's record; retry"


class JobEnded(Exception):
    """The job ended without its tokens: `state` FAILED, CANCELED, or TIMEOUT (our deadline)."""

    def __init__(self, state: str, reason: str) -> None:
        super().__init__(reason)
        self.state = state
