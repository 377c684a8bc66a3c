"""The settle leases that keep the spend sync from counting an entry twice, where they went wrong before (real
Redis, the ledger on SQLite and on PostgreSQL; `SETTLING_TTL_S` shortened to seconds): a biller lost between
its ledger write and its settle holds the sync off for one lease, however often its tenant is billed after;
while a lease holds the sync off, the sweep keeps a billed job's reservation (its $ is in no spend yet); a
biller that stalls past its lease counts its entry once, whether the sweep synced during the stall or not."""

from __future__ import annotations

import datetime as dt
import time
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from cp_kit import settings_fixture

import prfaas.control_plane.billing.meter as meter_mod
import prfaas.control_plane.billing.reconcile as reconcile_mod
import prfaas.control_plane.billing.spend as spend_mod
from prfaas.control_plane.billing.costs import JobUsage, PriceTable
from prfaas.control_plane.billing.ledger import Ledger
from prfaas.control_plane.billing.meter import Meter
from prfaas.control_plane.billing.models import UsageEntry
from prfaas.control_plane.billing.reconcile import reconcile
from prfaas.control_plane.jobs.errors import AdmissionRefused
from prfaas.control_plane.jobs.states import JobState
from prfaas.control_plane.services import Services
from prfaas.control_plane.tenants import Quota

PRICES = {"decode-b": {"usd_per_gpu_hour": 3.6}}  # 1 GPU-s = $0.001
ROOMY = Quota(rps=1000, concurrency=1000, budget_usd=100.0)


@pytest.fixture
def services(tmp_path: Path) -> Iterator[Services]:
    prices = tmp_path / "prices.yaml"
    prices.write_text(yaml.safe_dump({"max_age_s": 3600, "refresh_s": 3600, "regions": PRICES}))
    for settings in settings_fixture(prices={"path": str(prices)}):
        s = Services.create(settings)
        yield s
        s.close()


def _done_job(services: Services, tenant: str, reserve_usd: float = 0.0) -> str:
    """A job of `tenant` run locally in decode-b, DONE and not billed yet."""
    jobs = services.jobs
    fields = {"model": "tiny-llama", "prompt_tokens": 5, "max_new_tokens": 3}
    job = jobs.create(tenant, fields, ROOMY, reserve_usd=reserve_usd).job_id
    jobs.update(job, 1, placement_chosen="local", decode_region="decode-b")
    jobs.transition(job, JobState.LOCAL, 1, note="local in decode-b")
    jobs.transition(job, JobState.DONE, 1, completion_tokens=3, gen_first_s=0.2, gen_last_s=0.4)
    return job


def test_a_lost_settle_holds_the_sync_off_for_one_lease_however_often_its_tenant_is_billed(
    monkeypatch: pytest.MonkeyPatch, services: Services, ledger: Ledger
) -> None:
    monkeypatch.setattr(spend_mod, "SETTLING_TTL_S", 1)  # stands for 120 s
    meter = Meter(services, ledger)
    tenant = "t-" + uuid.uuid4().hex[:8]
    # a biller takes its lease and writes a $0.005 entry, then dies: no settle, and its lease is never handed back
    dead = meter.spend.settling([tenant])  # (held here: a context collected would hand its lease back)
    dead.__enter__()
    lost = JobUsage(job_id=str(uuid.uuid4()), tenant=tenant, model="m", prefill_region="decode-b",
                    decode_region="decode-b", prefill_gpu_s=0.0, decode_gpu_s=5.0, tokens_in=1, tokens_out=1,
                    finished_at=dt.datetime.now(dt.UTC))  # fmt: skip
    ledger.record_many([(lost, PriceTable(gpu_hour_usd={"decode-b": 3.6}))])
    until = time.monotonic() + 2.5
    while time.monotonic() < until:  # the tenant is billed more often than a lease lives, as a busy one is
        meter.bill(_done_job(services, tenant))
        time.sleep(0.3)
    meter.spend.sync(tenant, ledger)  # the sweep, now that the lost lease has run out
    total = ledger.spend(tenant, *spend_mod.month_window())
    assert total > 0.005 and services.jobs.spend(tenant) == pytest.approx(total)  # the lost $0.005 included
    with pytest.raises(AdmissionRefused, match="budget"):  # a tenant at its budget is not admitted past it
        services.jobs.admit(tenant, Quota(rps=1000, concurrency=1000, budget_usd=total))


def test_the_sweep_keeps_a_billed_jobs_reservation_while_a_lease_holds_its_sync_off(
    monkeypatch: pytest.MonkeyPatch, services: Services, ledger: Ledger
) -> None:
    monkeypatch.setattr(spend_mod, "SETTLING_TTL_S", 2)  # stands for 120 s
    monkeypatch.setattr(reconcile_mod, "SETTLE_GRACE_S", -1.0)  # every DONE job was billed long ago
    tenant = services.tenants.create("acme").id
    jobs = services.jobs
    meter = Meter(services, ledger)
    job = _done_job(services, tenant, reserve_usd=0.5)
    dead = meter.spend.settling([tenant])  # the lease of a biller that writes the entry and dies before its settle
    dead.__enter__()
    with monkeypatch.context() as m:
        m.setattr(meter.spend, "settle", lambda billed, *lease: {})
        entry = meter.bill(job)
    assert entry is not None and entry.total_usd > 0 and (jobs.spend(tenant), jobs.reserved(tenant)) == (0.0, 0.5)
    reconcile(meter)  # the lease holds the sync off: the job is in no spend, so its reservation still counts it
    assert (jobs.spend(tenant), jobs.reserved(tenant)) == (0.0, pytest.approx(0.5))
    time.sleep(2.1)
    reconcile(meter)  # the lease has run out: the sync counts the entry, and the reservation ends
    assert (jobs.spend(tenant), jobs.reserved(tenant)) == (pytest.approx(entry.total_usd), 0.0)


@pytest.mark.parametrize("swept", [True, False], ids=["swept-in-the-stall", "not-swept"])
def test_a_biller_stalled_past_its_lease_counts_its_entry_once(
    monkeypatch: pytest.MonkeyPatch, services: Services, ledger: Ledger, swept: bool
) -> None:
    monkeypatch.setattr(spend_mod, "SETTLING_TTL_S", 1)  # stands for 120 s
    tenant = "t-" + uuid.uuid4().hex[:8]
    jobs = services.jobs
    meter = Meter(services, ledger)
    job = _done_job(services, tenant, reserve_usd=0.5)
    record_many = ledger.record_many

    def stalled(batch: list[tuple[JobUsage, PriceTable]]) -> list[tuple[UsageEntry, bool]]:
        results = record_many(batch)
        time.sleep(1.5)  # past the lease: a lock wait, a GC pause
        if swept:
            meter.spend.sync(tenant, ledger)  # the sweep meanwhile: no live lease holds it off, it counts the entry
        return results

    monkeypatch.setattr(ledger, "record_many", stalled)
    entry = meter.bill(job)
    assert entry is not None and entry.total_usd > 0
    # counted once (by the sweep's sync, or by the biller's own when its settle found the lease run out) and
    # no longer reserved
    assert (jobs.spend(tenant), jobs.reserved(tenant)) == (pytest.approx(entry.total_usd), 0.0)


def _finished_last_month(monkeypatch: pytest.MonkeyPatch) -> float:
    """Bill every job as finished a second before this month began (just before midnight on the last day of
    the previous month); returns that time (epoch s)."""
    finished = spend_mod.month_window()[0] - dt.timedelta(seconds=1)
    job_usage = meter_mod.job_usage
    monkeypatch.setattr(meter_mod, "job_usage", lambda *a: replace(job_usage(*a), finished_at=finished))
    return finished.timestamp()


def test_a_late_settle_counts_its_entry_in_the_month_its_job_finished_in(
    monkeypatch: pytest.MonkeyPatch, services: Services, ledger: Ledger
) -> None:
    monkeypatch.setattr(spend_mod, "SETTLING_TTL_S", 1)  # stands for 120 s
    tenant = "t-" + uuid.uuid4().hex[:8]
    jobs = services.jobs
    meter = Meter(services, ledger)
    job = _done_job(services, tenant, reserve_usd=0.5)
    last_month = _finished_last_month(monkeypatch)
    record_many = ledger.record_many

    def stalled(batch: list[tuple[JobUsage, PriceTable]]) -> list[tuple[UsageEntry, bool]]:
        results = record_many(batch)
        time.sleep(1.5)  # past the lease: the settle adds nothing, the biller's own sync counts the entry
        return results

    monkeypatch.setattr(ledger, "record_many", stalled)
    entry = meter.bill(job)
    assert entry is not None and entry.total_usd > 0
    # counted in last month's spend (as the ledger counts it; the current month's sync found nothing to add),
    # and no longer reserved
    spent = float(services.redis.get(jobs.spend_key(tenant, last_month)) or 0.0)
    assert (spent, jobs.reserved(tenant)) == (pytest.approx(entry.total_usd), 0.0)


def test_the_sweep_counts_a_lost_settle_in_the_month_its_job_finished_in(
    monkeypatch: pytest.MonkeyPatch, services: Services, ledger: Ledger
) -> None:
    monkeypatch.setattr(reconcile_mod, "SETTLE_GRACE_S", -1.0)  # every DONE job was billed long ago
    tenant = services.tenants.create("acme").id
    jobs = services.jobs
    meter = Meter(services, ledger)
    job = _done_job(services, tenant, reserve_usd=0.5)
    last_month = _finished_last_month(monkeypatch)
    with monkeypatch.context() as m:  # the biller dies between its ledger write and its settle
        m.setattr(meter.spend, "settle", lambda billed, *lease: {})
        entry = meter.bill(job)
    assert entry is not None and entry.total_usd > 0
    # a sweep whose window reaches back into last month (as each one does early in a month): it syncs that month's
    # spend too, which counts the entry, and only then ends the job's reservation
    reconcile(meter, window_s=time.time() - last_month)
    spent = float(services.redis.get(jobs.spend_key(tenant, last_month)) or 0.0)
    assert (spent, jobs.reserved(tenant)) == (pytest.approx(entry.total_usd), 0.0)
