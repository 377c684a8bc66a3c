"""A split job that failed over is billed what its answering attempt shipped (real Redis, the ledger in a
SQLite file): the first attempt's KV bytes, recorded before it failed, are not the bill's, and the biller
waits for the last attempt's, which its prefill region reports after DONE. Its stage metrics are the
answering attempt's too: a local retry has no Reserve. And a bill whose spend settle fails after its ledger
write still counts in the metering metrics (the retry finds the entry written and observes nothing). A job
counts in the ledger queue until its bill is written."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import yaml
from cp_kit import settings_fixture
from prometheus_client import CollectorRegistry

from prfaas.control_plane.billing import meter as meter_module
from prfaas.control_plane.billing.ledger import Ledger
from prfaas.control_plane.billing.meter import Meter
from prfaas.control_plane.billing.reconcile import reconcile
from prfaas.control_plane.billing.spend import TenantSpend
from prfaas.control_plane.jobs.attempts import Attempts
from prfaas.control_plane.jobs.latency import stage_seconds
from prfaas.control_plane.jobs.leases import Leases
from prfaas.control_plane.jobs.states import JobState
from prfaas.control_plane.jobs.store import JobStore
from prfaas.control_plane.services import Services
from prfaas.control_plane.settings import Settings
from prfaas.control_plane.tenants import Quota

PRICES = {"prefill-a": {"usd_per_gpu_hour": 1.2}, "prefill-c": {"usd_per_gpu_hour": 1.2},
          "decode-b": {"usd_per_gpu_hour": 3.5}}  # fmt: skip
FIRST_WIRE, LAST_WIRE = 900_000_000, 2_000_000


@pytest.fixture
def stores(settings: Settings) -> Iterator[tuple[Services, Ledger]]:
    services = Services.create(settings)
    ledger = Ledger(settings.ledger.url)
    yield services, ledger
    ledger.close()
    services.close()


@pytest.fixture
def settings(tmp_path: Path) -> Iterator[Settings]:
    prices = tmp_path / "prices.yaml"
    prices.write_text(yaml.safe_dump({"max_age_s": 3600, "refresh_s": 3600, "regions": PRICES}))
    yield from settings_fixture(prices={"path": str(prices)})


def _new_job(jobs: JobStore) -> str:
    fields = {"model": "tiny-llama", "prompt_tokens": 5, "max_new_tokens": 3}
    return jobs.create("t-" + uuid.uuid4().hex[:8], fields, Quota(rps=100, concurrency=100, budget_usd=100)).job_id


def _split(services: Services, job: str, attempt: int, prefill: str) -> None:
    jobs = services.jobs
    jobs.update(job, attempt, placement_chosen="split", prefill_region=prefill, decode_region="decode-b")
    jobs.transition(job, JobState.PREFILLING, attempt, note=f"prefill in {prefill}")
    jobs.update(job, attempt, bytes_raw=4 * LAST_WIRE, prefill_gpu_s=0.1)  # at prefill_done: raw bytes only
    jobs.transition(job, JobState.TRANSFERRING, attempt, note="prefill done, KV shipping")


def test_a_failed_over_split_job_is_billed_its_last_attempts_wire_bytes(
    settings: Settings, stores: tuple[Services, Ledger]
) -> None:
    services, ledger = stores
    jobs = services.jobs
    job = _new_job(jobs)
    _split(services, job, 1, "prefill-a")
    jobs.update(job, 1, bytes_wire=FIRST_WIRE)  # shipped, then the decode region died
    attempts = Attempts(jobs, Leases(services.redis, settings), lambda *_: None, "test")
    assert attempts.fail(job, 1, "decode-b/0", "decode: UNAVAILABLE") == "retrying"
    assert int(jobs.get(job)["bytes_wire"]) == 0  # the new attempt has shipped nothing yet

    _split(services, job, 2, "prefill-c")
    jobs.transition(job, JobState.DECODING, 2, note="decoding")
    jobs.transition(job, JobState.DONE, 2, completion_tokens=3, gen_first_s=0.2, gen_last_s=0.4)
    # the prefill region's shipment_complete comes after DONE (the dispatcher records it then)
    late = threading.Timer(0.5, lambda: jobs.update(job, 2, bytes_wire=LAST_WIRE))
    late.start()
    entry = Meter(services, ledger).bill(job)
    late.join()
    assert entry is not None and entry.attempts == 2
    assert (entry.prefill_region, entry.kv_bytes_wire) == ("prefill-c", LAST_WIRE)


def _done_split(services: Services, tenant: str) -> str:
    fields = {"model": "tiny-llama", "prompt_tokens": 5, "max_new_tokens": 3}
    job = services.jobs.create(tenant, fields, Quota(rps=100, concurrency=100, budget_usd=100)).job_id
    _split(services, job, 1, "prefill-a")
    services.jobs.transition(job, JobState.DECODING, 1, note="decoding")
    services.jobs.transition(job, JobState.DONE, 1, completion_tokens=3, gen_first_s=0.2, gen_last_s=0.4)
    return job


def test_split_jobs_whose_wire_bytes_come_late_are_billed_them_by_the_sweep(
    stores: tuple[Services, Ledger], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Split jobs whose prefill region's shipment_complete has not come by the biller's wait hold it once for
    all of them (before: the wait each, in turn), and are left unbilled, not billed 0 egress for good: the sweep
    bills them their wire bytes once recorded. Only past the grace is a job billed without them."""
    services, ledger = stores
    jobs = services.jobs
    tenant = services.tenants.create("acme").id
    late = [_done_split(services, tenant) for _ in range(3)]
    meter = Meter(services, ledger)
    started = time.monotonic()
    assert meter.bill_many(late, wait_s=0.5) == []  # none billed yet: their bytes may still come
    assert time.monotonic() - started < 1.4, "each job waited for in turn"
    assert all(ledger.entry(job) is None for job in late)

    jobs.update(late[0], 1, bytes_wire=LAST_WIRE)  # the dispatcher records the late event
    assert reconcile(meter) == 1
    entry = ledger.entry(late[0])
    assert entry is not None and entry.kv_bytes_wire == LAST_WIRE and entry.egress_usd == 0.0  # no link price

    monkeypatch.setattr(meter_module, "WIRE_BYTES_GRACE_S", 0.0)  # the rest never come: billed without them
    assert reconcile(meter) == 2
    assert [ledger.entry(job).kv_bytes_wire for job in late[1:]] == [0, 0]  # type: ignore[union-attr]


def test_a_split_job_whose_wire_bytes_come_late_is_billed_by_its_own_biller(stores: tuple[Services, Ledger]) -> None:
    """The biller tries a deferred job again itself (5 s, doubling): the job is in its process's metrics, wire
    bytes included (the sweep's biller exports none), and it costs no second wait."""
    services, ledger = stores
    tenant = services.tenants.create("acme").id
    job = _done_split(services, tenant)
    registry = CollectorRegistry()
    meter = Meter(services, ledger, registry, batch_window_s=0, wire_wait_s=0.2)
    try:
        meter.job_done(job)
        assert meter.flush(10)
        assert ledger.entry(job) is None  # deferred: no bytes yet
        assert registry.get_sample_value("prfaas_ledger_queue_depth") == 1.0  # still waiting to be billed
        services.jobs.update(job, 1, bytes_wire=LAST_WIRE)
        deadline = time.monotonic() + 15
        while ledger.entry(job) is None and time.monotonic() < deadline:
            time.sleep(0.1)
        entry = ledger.entry(job)
        assert entry is not None and entry.kv_bytes_wire == LAST_WIRE
        assert registry.get_sample_value("prfaas_billed_jobs_total", {"placement": "split"}) == 1.0
        assert registry.get_sample_value("prfaas_ledger_queue_depth") == 0.0
    finally:
        meter.close()


def test_deferred_jobs_due_together_are_tried_again_in_one_batch(
    stores: tuple[Services, Ledger], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every split job of a prefill region that died after its hand-offs comes back at once: one batch, one Redis
    round trip and one ledger transaction, not one each (they came back one per batch)."""
    services, ledger = stores
    tenant = services.tenants.create("acme").id
    late = [_done_split(services, tenant) for _ in range(12)]
    monkeypatch.setattr(meter_module, "WIRE_RETRY_S", (0.5, 0.5))
    batches: list[int] = []

    class Counted(Meter):
        def bill_many(self, job_ids: list[str], wait_s: float = 5.0, deferred: list[str] | None = None) -> list:  # type: ignore[type-arg]
            batches.append(len(job_ids))
            return super().bill_many(job_ids, wait_s, deferred)

    meter = Counted(services, ledger, batch_window_s=0.05, wire_wait_s=0.1)
    try:
        for job in late:
            meter.job_done(job)
        assert meter.flush(10)
        for job in late:
            services.jobs.update(job, 1, bytes_wire=LAST_WIRE)
        deadline = time.monotonic() + 10
        while any(ledger.entry(job) is None for job in late) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert all(ledger.entry(job) is not None for job in late)
        assert batches[0] == 12 and len(batches) <= 4, batches  # the retries: all 12 together
    finally:
        meter.close()


def test_a_split_job_without_wire_bytes_is_billed_while_redis_still_holds_it(tmp_path: Path) -> None:
    """The grace is at most half the job's TTL: past it the job is billed 0 egress; after its TTL it would be gone
    from Redis (and its reservation released as gone) with no entry ever written."""
    prices = tmp_path / "prices.yaml"
    prices.write_text(yaml.safe_dump({"max_age_s": 3600, "refresh_s": 3600, "regions": PRICES}))
    for settings in settings_fixture(prices={"path": str(prices)}, job={"ttl_s": 2}):
        services = Services.create(settings)
        ledger = Ledger(settings.ledger.url)
        meter = Meter(services, ledger, batch_window_s=0, wire_wait_s=0.2)
        try:
            job = _done_split(services, services.tenants.create("acme").id)
            meter.job_done(job)
            deadline = time.monotonic() + 10
            while ledger.entry(job) is None and time.monotonic() < deadline:
                time.sleep(0.1)
            entry = ledger.entry(job)
            assert entry is not None and entry.kv_bytes_wire == 0, "never billed"
        finally:
            meter.close()
            ledger.close()
            services.close()


def test_a_local_retry_of_a_split_job_has_no_reserve_stage(settings: Settings) -> None:
    services = Services.create(settings)
    try:
        jobs = services.jobs
        job = _new_job(jobs)
        jobs.update(job, 1, placement_chosen="split", prefill_region="prefill-a", decode_region="decode-a")
        jobs.transition(job, JobState.PREFILLING, 1, note="prefill in prefill-a", reserve_s=4.2)
        attempts = Attempts(jobs, Leases(services.redis, settings), lambda *_: None, "test")
        assert attempts.fail(job, 1, "decode-a/0", "decode: UNAVAILABLE") == "retrying"

        jobs.update(job, 2, placement_chosen="local", decode_region="decode-b", placement_s=0.01)
        jobs.transition(job, JobState.LOCAL, 2, note="local in decode-b")
        jobs.transition(job, JobState.DONE, 2, completion_tokens=3)
        stages = stage_seconds(jobs.get(job), jobs.timeline(job))
        assert "reserve" not in stages and stages["placement"] == 0.01, stages  # attempt 1's 4.2 s Reserve
    finally:
        services.close()


class SettleFailsOnce(TenantSpend):
    """The spend's Redis step fails once, after the ledger write (Redis away for a moment)."""

    failed = False

    def settle(self, billed: object, lease: str) -> dict[str, list[str]]:
        if not self.failed:
            self.failed = True
            raise redis.ConnectionError("Redis away")
        return super().settle(billed, lease)  # type: ignore[arg-type]


def test_a_bill_whose_settle_fails_after_the_ledger_write_is_still_in_the_metrics(
    settings: Settings, stores: tuple[Services, Ledger]
) -> None:
    services, ledger = stores
    jobs = services.jobs
    job = _new_job(jobs)
    jobs.update(job, 1, placement_chosen="local", decode_region="decode-b")
    jobs.transition(job, JobState.LOCAL, 1, note="local in decode-b")
    jobs.transition(job, JobState.DONE, 1, completion_tokens=3, gen_first_s=0.2, gen_last_s=0.4)
    registry = CollectorRegistry()
    meter = Meter(services, ledger, registry)
    meter.spend = SettleFailsOnce(services.redis, jobs)
    with pytest.raises(redis.ConnectionError):
        meter.bill(job)
    entry = meter.bill(job)  # the retry: written before, so not settled nor observed again
    assert entry is not None and ledger.entry(job) is not None
    assert registry.get_sample_value("prfaas_billed_jobs_total", {"placement": "local"}) == 1.0


def test_a_job_counts_in_the_ledger_queue_until_its_bill_is_written(stores: tuple[Services, Ledger]) -> None:
    """`prfaas_ledger_queue_depth` is the finished jobs not billed yet: one whose ledger write is under way
    (a slow ledger) still counts; it leaves the gauge once written."""
    services, ledger = stores
    writing, release = threading.Event(), threading.Event()

    class SlowLedger(Meter):
        def bill_many(self, job_ids: list[str], wait_s: float = 5.0, deferred: list[str] | None = None) -> list:  # type: ignore[type-arg]
            writing.set()
            assert release.wait(10)
            return super().bill_many(job_ids, wait_s, deferred)

    registry = CollectorRegistry()
    meter = SlowLedger(services, ledger, registry, batch_window_s=0)
    try:
        meter.job_done(_new_job(services.jobs))  # not DONE: billed as nothing, but queued all the same
        assert writing.wait(10)
        assert registry.get_sample_value("prfaas_ledger_queue_depth") == 1.0
        release.set()
        assert meter.flush(10)
        assert registry.get_sample_value("prfaas_ledger_queue_depth") == 0.0
    finally:
        release.set()
        meter.close()
