"""What becomes of an attempt that cannot finish, whoever finds out (the prefill watcher, the
sweeper, the API process following the tokens): the job's next attempt, queued for Celery after
a backoff with jitter and leaving out the instances that failed it, or FAILED with the reason
once `max_attempts` are spent. One rule, in one place.

The instances an attempt failed on accumulate in the job's `excluded` field (JSON list of
`region/instance@t` entries, `t` on Redis's clock: when the incarnation placed registered, recorded at
placement, else the failure's time), so every later attempt
leaves them all out: the incarnations that failed, not one registered since (a restarted
instance keeps its id, and would be left out for good). A plain `region/instance`, written
before, leaves out every incarnation (fleet/records.py `InstanceRecord.excluded_by`).
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Callable
from typing import Any

from prfaas.control_plane.fleet.records import INCARNATION, exclusion
from prfaas.control_plane.jobs.errors import IllegalTransition, JobNotFound, StaleAttempt
from prfaas.control_plane.jobs.leases import Lease, Leases
from prfaas.control_plane.jobs.states import TERMINAL, JobState
from prfaas.control_plane.jobs.store import JobStore

log = logging.getLogger(__name__)
# A new attempt starts with no KV shipped, no Reserve and no refusal from a full decode instance: a failed-over
# split job is billed the bytes its last attempt shipped, and a local retry's stage metrics have no Reserve.
_ATTEMPT_FRESH: dict[str, Any] = {"bytes_raw": 0, "bytes_wire": 0, "reserve_s": "", "full_refusals": 0}
REGISTERED_SLACK_S = 0.001  # a placed incarnation's registration time, as an exclusion writes it (µs), and a
# margin: a restart registers seconds later
Enqueue = Callable[[str, float], object]  # (job id, countdown s): queue the job's dispatch


class Attempts:
    """`owner`: the process whose beats keep the `queued` leases it grants alive (a queued job
    whose dispatch is lost with its process is queued again by the sweeper)."""

    def __init__(self, jobs: JobStore, leases: Leases, enqueue: Enqueue, owner: str) -> None:
        self.jobs = jobs
        self.leases = leases
        self.settings = jobs.settings
        self.enqueue = enqueue
        self.owner = owner

    def _incarnation(self, job: dict[str, str], where: str) -> float:
        """The time up to which registrations of `where` (`region/instance`) are the incarnation that failed: when
        the one placed registered (recorded at placement, `*_registered_at`), so that an instance that restarted
        before its failure was noticed (a broken stream takes seconds to tell) is not left out; else now."""
        for role in ("decode", "prefill"):
            placed = float(job.get(f"{role}_registered_at") or 0)
            if placed > 0 and where == f"{job.get(f'{role}_region')}/{job.get(f'{role}_instance')}":
                return placed + REGISTERED_SLACK_S
        return self.leases.clock.now()

    def backoff_s(self, attempt: int) -> float:
        return float(self.settings.backoff_s * 2 ** (attempt - 1) * random.uniform(0.5, 1.5))

    def fail(self, job_id: str, attempt: int, where: str, reason: str, **fields: Any) -> str:
        """Attempt `attempt` of `job_id` ended without finishing, on `where` ("" when no
        instance is to blame). Returns "retrying", "failed", or "superseded" when the job had
        already moved on (a newer attempt, a cancel, DONE): then nothing is changed, the newer
        attempt's lease least of all. `fields` go with the move to QUEUED."""
        try:
            job = self.jobs.get(job_id)
        except JobNotFound:
            return "superseded"
        if job["state"] in TERMINAL or int(job["attempt"]) != attempt:  # a late caller: checked again in the move
            log.info("job %s attempt %d failed (%s), but the job moved on: %s %s", job_id, attempt, reason,
                     job["state"], job["attempt"])  # fmt: skip
            return "superseded"
        log.warning("job %s attempt %d failed on %s: %s", job_id, attempt, where or "-", reason)
        excluded = set(json.loads(job.get("excluded") or "[]"))
        if where:  # an instance: its latest failure's entry covers the earlier ones' incarnations too
            excluded = {e for e in excluded if not e.startswith(where + INCARNATION)}
            excluded.add(exclusion(where, self._incarnation(job, where)) if "/" in where else where)
        backoff = self.backoff_s(attempt)
        try:
            if attempt >= self.settings.max_attempts:
                self.jobs.transition(job_id, JobState.FAILED, attempt, note=reason, error=reason, tenant=job["tenant"])
                return "failed"
            # the KV bytes are the attempt's own: the next one records what it ships, and the bill waits for it;
            # the next attempt's `queued` lease comes with the move: never a QUEUED job unwatched, and a refused
            # (stale) move grants nothing
            self.jobs.transition(job_id, JobState.QUEUED, attempt + 1, note=reason, tenant=job["tenant"],
                                 grant=self._queued(job_id, attempt + 1, backoff), excluded=sorted(excluded),
                                 **(_ATTEMPT_FRESH | fields))  # fmt: skip
        except (StaleAttempt, IllegalTransition, JobNotFound):
            return "superseded"
        self.enqueue(job_id, backoff)
        return "retrying"

    def unclaim(self, job_id: str, attempt: int, countdown_s: float) -> bool:
        """Give back the claim on `attempt` (still QUEUED: it was not placed) and queue its
        dispatch again after `countdown_s`; False if the job moved on meanwhile."""
        if not self.leases.unclaim(self._queued(job_id, attempt, countdown_s)):
            return False
        self.enqueue(job_id, countdown_s)
        return True

    def requeue(self, job_id: str, attempt: int) -> bool:
        """Queue the dispatch of `attempt` again, if the job is still QUEUED at it and unclaimed (a
        dispatch that claimed it since runs it); False when not."""
        if not self.leases.requeue(self._queued(job_id, attempt, 0.0)):
            return False
        self.enqueue(job_id, 0.0)
        return True

    def _queued(self, job_id: str, attempt: int, countdown_s: float) -> Lease:
        """The `queued` lease of `attempt`'s dispatch, queued with `countdown_s`."""
        deadline = self.leases.clock.now() + countdown_s + self.settings.dispatch.visibility_s
        return Lease(job_id, attempt, "queued", self.owner, "", deadline)
