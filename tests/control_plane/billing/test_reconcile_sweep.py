"""What a reconciliation sweep costs, and what it still does (real Redis, the ledger on SQLite and on
PostgreSQL): a sweep over jobs already reconciled asks the ledger a bounded number of queries however many jobs
its window holds (which DONE jobs are billed, which wasted attempts are recorded: one query each per 500 jobs),
and a wasted attempt that a crash left unrecorded is recorded by the next sweep."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
import yaml
from cp_kit import settings_fixture

from prfaas.control_plane.billing.ledger import Ledger
from prfaas.control_plane.billing.meter import Meter
from prfaas.control_plane.billing.reconcile import reconcile
from prfaas.control_plane.jobs.states import JobState
from prfaas.control_plane.services import Services
from prfaas.control_plane.tenants import Quota

PRICES = {"decode-b": {"usd_per_gpu_hour": 3.6}}
ROOMY = Quota(rps=1000, concurrency=1000, budget_usd=100.0)
FIELDS = {"model": "tiny-llama", "prompt_tokens": 5, "max_new_tokens": 3}
N = 30  # jobs of each kind: a sweep of HEAD's asked the ledger ~5 N queries for them


@pytest.fixture
def services(tmp_path: Path) -> Iterator[Services]:
    prices = tmp_path / "prices.yaml"
    prices.write_text(yaml.safe_dump({"max_age_s": 3600, "refresh_s": 3600, "regions": PRICES}))
    for settings in settings_fixture(prices={"path": str(prices)}):
        s = Services.create(settings)
        yield s
        s.close()


def _done_job(services: Services, tenant: str) -> str:
    """A job run locally in decode-b, DONE and not billed yet."""
    jobs = services.jobs
    job = jobs.create(tenant, FIELDS, ROOMY).job_id
    jobs.update(job, 1, placement_chosen="local", decode_region="decode-b")
    jobs.transition(job, JobState.LOCAL, 1, note="local in decode-b")
    jobs.transition(job, JobState.DONE, 1, completion_tokens=3, gen_first_s=0.2, gen_last_s=0.4)
    return job


def _failed_job(services: Services, tenant: str) -> str:
    """A job whose two attempts each held decode-b's GPU (2 ms) before it FAILED: two wasted prefill rows."""
    jobs = services.jobs
    job = jobs.create(tenant, FIELDS, ROOMY).job_id
    jobs.update(job, 1, placement_chosen="split", regions_a1="decode-b>decode-b", regions_a2="decode-b>decode-b")
    jobs.transition(job, JobState.PREFILLING, 1, note="prefill in decode-b")
    time.sleep(0.002)
    jobs.transition(job, JobState.QUEUED, 2, note="prefill in decode-b: UNAVAILABLE")
    jobs.transition(job, JobState.PREFILLING, 2, note="prefill in decode-b")
    time.sleep(0.002)
    jobs.transition(job, JobState.FAILED, 2, note="prefill in decode-b: UNAVAILABLE")
    return job


def test_a_sweep_over_reconciled_jobs_asks_the_ledger_a_bounded_number_of_queries(
    services: Services, ledger: Ledger
) -> None:
    tenant = services.tenants.create("acme").id
    jobs = services.jobs
    meter = Meter(services, ledger)
    done = [_done_job(services, tenant) for _ in range(N)]
    meter.bill_many(done[: N // 2])  # the meter billed half; the API process of the other half died first
    failed = [_failed_job(services, tenant) for _ in range(N)]
    idle = jobs.create(tenant, FIELDS, ROOMY).job_id  # canceled while queued: no GPU held, nothing wasted
    jobs.transition(idle, JobState.CANCELED, 0)
    gone = _done_job(services, tenant)
    services.redis.delete(services.settings.key("job", gone))  # expired, still in the tenant's index
    assert reconcile(meter) == N - N // 2
    assert all(ledger.entry(job) is not None for job in done) and ledger.entry(gone) is None
    assert all([(w.attempt, w.phase) for w in ledger.wasted(job)] == [(1, "prefill"), (2, "prefill")] for job in failed)
    statements: list[str] = []

    def count(conn: Any, cursor: Any, statement: str, *rest: Any) -> None:
        statements.append(statement)

    sa.event.listen(ledger.engine, "before_cursor_execute", count)
    try:
        assert reconcile(meter) == 0
    finally:
        sa.event.remove(ledger.engine, "before_cursor_execute", count)
    # which DONE jobs are billed, which wasted attempts are recorded, the tenant's spend of the month
    assert len(statements) <= 4, f"{len(statements)} queries: {statements[:4]}"


def test_a_wasted_attempt_a_crash_left_unrecorded_is_recorded_by_the_next_sweep(
    monkeypatch: pytest.MonkeyPatch, services: Services, ledger: Ledger
) -> None:
    tenant = services.tenants.create("acme").id
    meter = Meter(services, ledger)
    job = _failed_job(services, tenant)
    record = ledger.record_wasted_once

    def dies_after_the_first(**row: Any) -> Any:
        if ledger.wasted(job):
            raise RuntimeError("the worker died")
        return record(**row)

    with monkeypatch.context() as m:
        m.setattr(ledger, "record_wasted_once", dies_after_the_first)
        reconcile(meter)  # logged; the sweep goes on
    assert [(w.attempt, w.phase) for w in ledger.wasted(job)] == [(1, "prefill")]
    reconcile(meter)
    assert [(w.attempt, w.phase) for w in ledger.wasted(job)] == [(1, "prefill"), (2, "prefill")]
