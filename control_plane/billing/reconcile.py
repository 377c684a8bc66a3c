"""The reconciliation sweep (the beat task `prfaas.reconcile_ledger`, every minute): bills DONE jobs that have
no ledger entry (their API process died between DONE and the write), records the wasted attempts of FAILED /
CANCELED jobs, raises every tenant's monthly spend in Redis to the ledger's sum, and ends budget reservations
left behind (a job gone from Redis, a FAILED / CANCELED one, a DONE one billed over `SETTLE_GRACE_S` ago whose
writer died before settling it, once the sync has counted it). Idempotent: the ledger writes once per job and
once per (job, attempt, phase).
"""

from __future__ import annotations

import logging
import time

from prfaas.control_plane.billing.meter import Meter
from prfaas.control_plane.jobs.errors import JobNotFound
from prfaas.control_plane.jobs.states import JobState

SETTLE_GRACE_S = 60.0  # a DONE job's biller settles it within this long of billing it, or not at all
log = logging.getLogger(__name__)


def reconcile(meter: Meter, window_s: float = 3600.0) -> int:
    """Sweep the jobs created in the last `window_s` (plus a job's timeout); returns the entries written."""
    s = meter.s
    written = 0
    now = time.time()
    for tenant in s.tenants.all():
        index = s.settings.key("tenant", tenant.id, "jobs")
        for raw in s.redis.zrangebyscore(index, now - window_s - s.settings.job.timeout_s, now):  # type: ignore[union-attr]
            job_id = raw.decode() if isinstance(raw, bytes) else str(raw)
            try:
                written += _reconcile_job(meter, job_id)
            except Exception:  # one job that cannot be billed (no price for a region gone) stops no other
                log.exception("reconcile: job %s of tenant %s; the next sweep tries again", job_id, tenant.id)
        try:
            synced = meter.spend.sync(tenant.id, meter.ledger)
            meter.spend.release(tenant.id, left_behind(meter, tenant.id, now, synced))
        except Exception:
            log.exception("reconcile: the spend of tenant %s; the next sweep tries again", tenant.id)
    return written


def _reconcile_job(meter: Meter, job_id: str) -> int:
    """Bill a DONE job the meter missed (1 when written), or record a FAILED / CANCELED job's wasted attempts."""
    s = meter.s
    try:
        job = s.jobs.get(job_id)
    except JobNotFound:
        return 0
    if job["state"] == JobState.DONE and meter.ledger.entry(job_id) is None:
        return int(meter.bill(job_id) is not None)
    if job["state"] in (JobState.FAILED, JobState.CANCELED):
        meter.record_wasted(job, s.jobs.timeline(job_id), range(1, int(job["attempt"]) + 1))
    return 0


def left_behind(meter: Meter, tenant: str, now: float, synced: bool) -> list[str]:
    """The tenant's jobs holding a budget reservation that nothing will end any more. `synced`: whether this
    sweep's sync raised the spend to the ledger's sum; while a settle lease held it off, a billed job's $ may be
    in neither the spend nor (if its reservation ended here) the reserved sum, so those reservations stay."""
    stale = []
    for job_id in meter.spend.reservations(tenant):
        try:
            job = meter.s.jobs.get(job_id)
        except JobNotFound:
            stale.append(job_id)
            continue
        ended_unbilled = job["state"] in (JobState.FAILED, JobState.CANCELED)
        billed_long_ago = job["state"] == JobState.DONE and now - float(job["updated_at"]) > SETTLE_GRACE_S
        # synced, billed long ago and in the ledger: the spend sync above counted it
        if ended_unbilled or (synced and billed_long_ago and meter.ledger.entry(job_id) is not None):
            stale.append(job_id)
    return stale
