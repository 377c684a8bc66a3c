"""The reconciliation sweep (the beat task `prfaas.reconcile_ledger`, every minute): bills the jobs due a bill
(DONE, or canceled by their client after tokens came: billing/usage.py's `billable`) that have no ledger entry
(their API process died between the end and the write, or their wire bytes came after the biller's wait:
`Meter.bill_many`), records the wasted attempts of the other FAILED /
CANCELED jobs, raises every tenant's monthly spend in Redis to the ledger's sum (of each month its window reaches
into: a job counts in the month it finished in), and ends budget reservations left behind (a job gone from Redis,
a FAILED / CANCELED one, a DONE one billed over `SETTLE_GRACE_S` ago whose writer died before settling it, once
the sync has counted it). Idempotent: the ledger writes once per job and once per (job, attempt, phase).

Its cost grows with the jobs that need work: the window's jobs are read `BATCH` at a time (their states in one
Redis round trip, which of the DONE ones are billed and which wasted attempts of the ended ones are recorded in
one SQL query each), and only a job with something missing is billed or recorded, one by one where a batch
fails (one job that cannot be billed stops no other).
"""

from __future__ import annotations

import logging
import time

from prfaas.control_plane.billing.meter import Meter
from prfaas.control_plane.billing.spend import months
from prfaas.control_plane.billing.usage import billable, wasted_work
from prfaas.control_plane.jobs.states import JobState

SETTLE_GRACE_S = 60.0  # a DONE job's biller settles it within this long of billing it, or not at all
CUT_GRACE_S = 60.0  # a job's follower records what its stream got within this long of its client's cancel
BATCH = 500  # jobs per Redis round trip and per SQL query
ENDED_UNBILLED = (JobState.FAILED, JobState.CANCELED)
log = logging.getLogger(__name__)


def reconcile(meter: Meter, window_s: float = 3600.0) -> int:
    """Sweep the jobs created in the last `window_s` (plus a job's timeout); returns the entries written."""
    s = meter.s
    written = 0
    now = time.time()
    since = now - window_s - s.settings.job.timeout_s
    for tenant in s.tenants.all():
        index = s.settings.key("tenant", tenant.id, "jobs")
        raws = s.redis.zrangebyscore(index, since, now)
        job_ids = [raw.decode() if isinstance(raw, bytes) else str(raw) for raw in raws]  # type: ignore[union-attr]
        for start in range(0, len(job_ids), BATCH):
            batch = job_ids[start : start + BATCH]
            try:
                written += _reconcile_batch(meter, batch)
            except Exception:  # a read failed (Redis, the ledger away): the rest of the tenant's jobs still go
                log.exception("reconcile: %d jobs of tenant %s; the next sweep tries again", len(batch), tenant.id)
        try:
            # each month a job of the window may have finished in (the last one's too, early in a month): a
            # settle lost for a job that finished before midnight is counted in the month the ledger counts it in
            ran = [meter.spend.sync(tenant.id, meter.ledger, month) for month in months(since, now)]
            meter.spend.release(tenant.id, left_behind(meter, tenant.id, now, all(ran)))
        except Exception:
            log.exception("reconcile: the spend of tenant %s; the next sweep tries again", tenant.id)
    return written


def _reconcile_batch(meter: Meter, job_ids: list[str]) -> int:
    """Bill the `billable` jobs of `job_ids` the meter missed (DONE, or canceled by their client after tokens
    came) and record the wasted attempts of the other FAILED / CANCELED ones not recorded yet; returns the
    entries written. Jobs gone from Redis are skipped, and so is a job its client canceled whose follower may
    still record what it got (`CUT_GRACE_S`)."""
    names = ["state", "attempt", "updated_at", "client_canceled", "canceled_at"]  # and what `billable` reads
    names += ["cut_tokens", "cut_attempt", "cut_first_at"]
    states = meter.s.jobs.fields_of(job_ids, names)
    done: list[str] = []
    ended: list[str] = []
    for job_id, job in zip(job_ids, states, strict=True):
        if job is None:
            continue
        if billable(job):
            done.append(job_id)
        elif job["state"] in ENDED_UNBILLED and not _cut_pending(job):
            (ended if _waste(meter, job_id, job) else done).append(job_id)
    billed = meter.ledger.billed(done)
    written = _bill(meter, [j for j in done if j not in billed])
    if ended:
        _record_wasted(meter, ended)
    return written


def _cut_pending(job: dict[str, str]) -> bool:
    """A job its client canceled with no `cut_tokens` yet, canceled under `CUT_GRACE_S` ago: its follower may
    still record the tokens it got (then it is billed, not the platform's waste)."""
    recent = time.time() - float(job.get("updated_at") or 0) < CUT_GRACE_S
    return job.get("client_canceled") == "1" and not job.get("cut_tokens") and recent


def _waste(meter: Meter, job_id: str, job: dict[str, str]) -> bool:
    """Whether an ended, unbilled job is the platform's cost for good. A job its client canceled is closed to its
    follower's record first (`cut_closed`, set only while it has no `cut_tokens`, in one step): a follower that
    records what it got after this (a stalled process) is refused, so its attempt is never both billed and
    wasted. False: the record came meanwhile, and the job is billed instead."""
    if job.get("client_canceled") != "1" or job.get("cut_tokens"):  # not its client's; a failed attempt's record
        return True
    return meter.s.jobs.update(job_id, int(job["attempt"]), unless="cut_tokens", cut_closed=1)


def _bill(meter: Meter, job_ids: list[str]) -> int:
    """Bill these jobs together, or one by one when that fails (an unpriced one stops no other)."""
    if not job_ids:
        return 0
    try:
        return len(meter.bill_many(job_ids, wait_s=0))
    except Exception:
        log.warning("reconcile: billing %d jobs together failed; billing them one by one", len(job_ids), exc_info=True)
    written = 0
    for job_id in job_ids:
        try:
            written += int(meter.bill(job_id, wait_s=0) is not None)
        except Exception:
            log.exception("reconcile: job %s; the next sweep tries again", job_id)
    return written


def _record_wasted(meter: Meter, job_ids: list[str]) -> None:
    """`Meter.record_wasted` for each FAILED / CANCELED job one of whose rows is missing: never recorded, or a
    writer (or sweep) died part way. An unpriced attempt stays missing, so its job is tried every sweep."""
    recorded = meter.ledger.wasted_recorded(job_ids)
    for job_id, found in zip(job_ids, meter.s.jobs.with_timelines(job_ids), strict=True):
        if found is None:
            continue
        job, timeline = found
        if billable(job):  # its follower's record came after all: billed, none of it wasted
            continue
        try:
            attempts = range(1, int(job["attempt"]) + 1)
            # the rows record_wasted writes: one per (attempt, phase) that held a GPU
            due = {(job_id, w.attempt, w.phase) for w in wasted_work(job, timeline, attempts) if w.gpu_s > 0}
            if due - recorded:
                meter.record_wasted(job, timeline, attempts)
        except Exception:
            log.exception("reconcile: the wasted attempts of job %s; the next sweep tries again", job_id)


def left_behind(meter: Meter, tenant: str, now: float, synced: bool) -> list[str]:
    """The tenant's jobs holding a budget reservation that nothing will end any more. `synced`: whether this
    sweep's sync raised the spend to the ledger's sum; while a settle lease held it off, a billed job's $ may be
    in neither the spend nor (if its reservation ended here) the reserved sum, so those reservations stay."""
    held = list(meter.spend.reservations(tenant))
    stale, billed_long_ago = [], []
    for start in range(0, len(held), BATCH):
        batch = held[start : start + BATCH]
        for job_id, job in zip(batch, meter.s.jobs.fields_of(batch, ["state", "updated_at"]), strict=True):
            if job is None or job["state"] in ENDED_UNBILLED:  # gone from Redis, or ended unbilled
                stale.append(job_id)
            elif synced and job["state"] == JobState.DONE and now - float(job["updated_at"]) > SETTLE_GRACE_S:
                billed_long_ago.append(job_id)
    # synced, billed long ago and in the ledger: the spend sync above counted it
    billed = meter.ledger.billed(billed_long_ago)
    return stale + [job_id for job_id in billed_long_ago if job_id in billed]
