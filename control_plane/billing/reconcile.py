"""The reconciliation sweep (the beat task `prfaas.reconcile_ledger`, every minute): bills DONE jobs that have
no ledger entry (their API process died between DONE and the write), records the wasted attempts of FAILED /
CANCELED jobs, and raises every tenant's monthly spend in Redis to the ledger's sum. Idempotent: the ledger
writes once per job and once per (job, attempt, phase)."""

from __future__ import annotations

import time

from prfaas.control_plane.billing.meter import Meter
from prfaas.control_plane.jobs.errors import JobNotFound
from prfaas.control_plane.jobs.states import JobState


def reconcile(meter: Meter, window_s: float = 3600.0) -> int:
    """Sweep the jobs created in the last `window_s` (plus a job's timeout); returns the entries written."""
    s = meter.s
    written = 0
    now = time.time()
    for tenant in s.tenants.all():
        index = s.settings.key("tenant", tenant.id, "jobs")
        for raw in s.redis.zrangebyscore(index, now - window_s - s.settings.job_timeout_s, now):  # type: ignore[union-attr]
            job_id = raw.decode() if isinstance(raw, bytes) else str(raw)
            try:
                job = s.jobs.get(job_id)
            except JobNotFound:
                continue
            if job["state"] == JobState.DONE and meter.ledger.entry(job_id) is None:
                written += meter.bill(job_id) is not None
            elif job["state"] in (JobState.FAILED, JobState.CANCELED):
                meter.record_wasted(job, s.jobs.timeline(job_id), range(1, int(job["attempt"]) + 1))
        meter.spend.sync(tenant.id, meter.ledger)
    return written
