"""Metering on real processes (metering_kit's stack): exactly one ledger entry per finished job, the sums
recomputed from the recorded GPU-seconds x the configured prices, `GET /v1/usage` in every grouping and as CSV,
tenant isolation, the admin view, 4xx on bad parameters, budgets enforced from the ledger (402), billing
idempotent when run again, and the metering metrics."""

from __future__ import annotations

import csv
import io
import time
from collections import Counter

import httpx
import openai
import pytest
from cp_kit import stack_settings
from metering_kit import EGRESS_USD_PER_GB, PRICES, Metered, wait_billed

from prfaas.control_plane.billing.ledger import Ledger
from prfaas.control_plane.billing.meter import Meter
from prfaas.control_plane.billing.models import UsageEntry
from prfaas.control_plane.billing.reconcile import reconcile
from prfaas.control_plane.jobs.states import JobState
from prfaas.control_plane.services import Services
from prfaas.control_plane.tenants import Quota
from prfaas.devstack.stack import ADMIN, wait_until

pytestmark = pytest.mark.e2e


def _cost(e: UsageEntry) -> float:
    """A job's bill from its GPU-seconds and the configured prices (not the entry's stored prices)."""
    split = e.prefill_region != e.decode_region
    p_price = (
        PRICES[e.prefill_region]["spot_usd_per_gpu_hour"] if split else PRICES[e.decode_region]["usd_per_gpu_hour"]
    )
    d_price = PRICES[e.decode_region]["usd_per_gpu_hour"]
    egress = e.kv_bytes_wire / 1e9 * EGRESS_USD_PER_GB if split else 0.0
    return e.prefill_gpu_s / 3600 * p_price + e.decode_gpu_s / 3600 * d_price + egress  # type: ignore[operator]


def _usage(m: Metered, tenant: str, **params: str) -> httpx.Response:
    return httpx.get(m.stack.url + "/v1/usage", params=params, headers=m.headers(tenant), timeout=10)


def test_one_entry_per_finished_job_and_sums_from_gpu_seconds(metered: Metered) -> None:
    m = metered
    entries = [e for e in m.entries() if e.tenant in (m.ids["alpha"], m.ids["beta"])]
    finished = []
    for tenant in ("alpha", "beta"):
        listed = httpx.get(m.stack.url + "/v1/jobs", headers=m.headers(tenant), timeout=10).json()["data"]
        finished += [j["id"] for j in listed if j["state"] == "DONE"]
    per_job = Counter(e.job_id for e in entries)
    assert sorted(per_job) == sorted(finished) and set(per_job.values()) == {1}
    assert {e.placement for e in entries} == {"split", "local"}
    for e in entries:
        assert e.prefill_gpu_s > 0 and e.decode_gpu_s > 0, e.job_id
        assert e.total_usd == pytest.approx(_cost(e), rel=1e-9)
        if e.placement == "split":
            assert (e.prefill_region, e.decode_region) == ("prefill-a", "decode-b")
            assert e.prefill_usd_per_gpu_h == 0.6 and e.egress_usd_per_gb == EGRESS_USD_PER_GB
            assert e.kv_bytes_raw > 0 and e.kv_bytes_wire > 0
        assert e.decode_usd_per_gpu_h == 3.5  # the table's price, not the 4.0 the region registered
        assert e.ttft_s is not None and e.ttft_s > 0
    for tenant in ("alpha", "beta"):
        mine = [e for e in entries if e.tenant == m.ids[tenant]]
        by_day = _usage(m, tenant, group_by="day").json()
        assert sum(r["total_usd"] for r in by_day["data"]) == pytest.approx(sum(_cost(e) for e in mine), rel=1e-9)
        assert sum(r["jobs"] for r in by_day["data"]) == len(mine) == len(m.jobs[tenant])


def test_usage_groupings_agree_and_csv_matches(metered: Metered) -> None:
    m = metered
    totals = {}
    for group_by in ("day", "region", "phase", "model"):
        reply = _usage(m, "alpha", group_by=group_by)
        assert reply.status_code == 200, reply.text
        totals[group_by] = sum(r["total_usd"] for r in reply.json()["data"])
    assert totals["region"] == pytest.approx(totals["day"]) and totals["phase"] == pytest.approx(totals["day"])
    assert totals["model"] == pytest.approx(totals["day"])
    phases = {r["key"]: r for r in _usage(m, "alpha", group_by="phase").json()["data"]}
    assert set(phases) == {"prefill", "decode", "egress"} and phases["egress"]["kv_bytes_wire"] > 0
    regions = {r["key"] for r in _usage(m, "alpha", group_by="region").json()["data"]}
    assert regions == {"prefill-a", "decode-b"}
    reply = _usage(m, "alpha", group_by="region", format="csv")
    assert reply.headers["content-type"].startswith("text/csv") and "attachment" in reply.headers["content-disposition"]
    rows = list(csv.DictReader(io.StringIO(reply.text)))
    assert sum(float(r["total_usd"]) for r in rows) == pytest.approx(totals["region"])
    assert {r["region"] for r in rows} == regions


def test_tenants_see_only_their_usage(metered: Metered) -> None:
    m = metered
    alpha_jobs = sum(r["jobs"] for r in _usage(m, "alpha").json()["data"])
    beta_jobs = sum(r["jobs"] for r in _usage(m, "beta").json()["data"])
    assert (alpha_jobs, beta_jobs) == (len(m.jobs["alpha"]), len(m.jobs["beta"]))
    own = httpx.get(f"{m.stack.url}/v1/usage/jobs/{m.jobs['alpha'][0]}", headers=m.headers("alpha"), timeout=5)
    assert own.status_code == 200 and own.json()["tenant"] == m.ids["alpha"]
    other = httpx.get(f"{m.stack.url}/v1/usage/jobs/{m.jobs['alpha'][0]}", headers=m.headers("beta"), timeout=5)
    not_found = {
        "message": "usage entry not found",
        "type": "not_found_error",
        "param": None,
        "code": "usage_entry_not_found",
    }
    assert (other.status_code, other.json()) == (404, {"error": not_found})
    admin = httpx.get(m.stack.url + "/admin/usage", params={"group_by": "tenant"}, headers=ADMIN, timeout=5).json()
    mine = {m.ids["alpha"], m.ids["beta"]}  # the fixture's tenants (other tests of the stack add their own)
    assert {r["key"]: r["jobs"] for r in admin["data"] if r["key"] in mine} == {
        m.ids["alpha"]: alpha_jobs, m.ids["beta"]: beta_jobs}  # fmt: skip
    assert httpx.get(m.stack.url + "/admin/usage", headers=m.headers("alpha"), timeout=5).status_code == 403
    # a CSV named after a tenant id in any script (headers are latin-1): ASCII fallback + exact UTF-8 name
    params = {"group_by": "model", "format": "csv", "tenant": 'Ā"ü'}
    csv_reply = httpx.get(m.stack.url + "/admin/usage", params=params, headers=ADMIN, timeout=5)
    assert csv_reply.status_code == 200, csv_reply.text
    assert csv_reply.headers["content-disposition"].startswith('attachment; filename="usage-___-model-')
    assert "filename*=UTF-8''usage-%C4%80%22%C3%BC-model-" in csv_reply.headers["content-disposition"]
    assert httpx.get(m.stack.url + "/v1/usage", timeout=5).status_code == 401


@pytest.mark.parametrize(
    ("params", "message", "param"),
    [
        ({"group_by": "week"}, "invalid request: group_by: Input should be", "group_by"),
        ({"from": "yesterday"}, "invalid request: from: Input should be", "from"),
        ({"from": "2026-11-10", "to": "2026-11-01"}, "invalid range: to must be after from", "to"),
        ({"from": "2020-01-01", "to": "2026-01-01"}, "invalid range: at most 400 days", "from"),
        ({"format": "xml"}, "invalid request: format: Input should be", "format"),
        ({"from": "9999-12-31T23:59:59-23:59"}, "invalid range: from is outside the years 1-9999", "from"),
        ({"to": "0001-01-01T00:00:00+23:59"}, "invalid range: to is outside the years 1-9999", "to"),
    ],
)
def test_bad_usage_parameters_are_400(metered: Metered, params: dict[str, str], message: str, param: str) -> None:
    reply = _usage(metered, "alpha", **params)
    error = reply.json()["error"]
    assert reply.status_code == 400 and error["message"].startswith(message) and error["param"] == param, reply.text
    assert error["type"] == "invalid_request_error"


def test_billing_again_changes_nothing(metered: Metered) -> None:
    """A second biller (another process's Meter on the same Redis and ledger) gets the stored entries."""
    m = metered
    settings = stack_settings(m.stack)
    services = Services.create(settings)
    ledger = Ledger(m.stack.ledger_url)
    try:
        meter = Meter(services, ledger)
        before = {e.job_id: (e.id, e.total_usd) for e in m.entries()}
        for job_id in m.jobs["alpha"]:
            entry = meter.bill(job_id)
            assert entry is not None and (entry.id, entry.total_usd) == before[job_id]
        assert reconcile(meter) == 0
        assert {e.job_id: (e.id, e.total_usd) for e in m.entries()} == before
    finally:
        ledger.close()
        services.close()


SWEPT_FIELDS = {"model": "tiny-llama", "prompt_tokens": 5, "max_new_tokens": 3}
SWEPT_QUOTA = Quota(rps=100, concurrency=100, budget_usd=100)


def _done_locally(services: Services, tenant_id: str, region: str) -> str:
    """A job run locally in `region` and moved to DONE without `job_done` (its API process died in between)."""
    jobs = services.jobs
    job = jobs.create(tenant_id, SWEPT_FIELDS, SWEPT_QUOTA).job_id
    jobs.update(job, 1, placement_chosen="local", decode_region=region, prefill_region=region)
    jobs.transition(job, JobState.LOCAL, 1, note=f"local in {region}")
    timing = {"gen_first_s": 0.2, "gen_last_s": 0.5, "first_token_at": time.time()}
    jobs.transition(job, JobState.DONE, 1, completion_tokens=3, **timing)
    return job


def test_sweep_bills_a_job_its_api_process_never_billed(metered: Metered, monkeypatch: pytest.MonkeyPatch) -> None:
    """A job moved to DONE without `job_done` (its API process died in between) and a FAILED job: the
    reconciliation sweep bills the first once and records the second's attempt as platform cost."""
    m = metered
    monkeypatch.setenv("PRFAAS_PRICES_PATH", m.stack.env["PRFAAS_PRICES_PATH"])  # the stack's price table
    services = Services.create(stack_settings(m.stack))
    ledger = Ledger(m.stack.ledger_url)
    try:
        tenant_id, _ = m.stack.tenant("delta")
        jobs = services.jobs
        done = _done_locally(services, tenant_id, "decode-b")
        failed = jobs.create(tenant_id, SWEPT_FIELDS, SWEPT_QUOTA).job_id
        jobs.update(failed, 1, placement_chosen="split", **{"regions_a1": "prefill-a>decode-b"})
        jobs.transition(failed, JobState.PREFILLING, 1, note="prefill in prefill-a")
        time.sleep(0.2)
        jobs.transition(failed, JobState.FAILED, 1, note="prefill in prefill-a: UNAVAILABLE")
        meter = Meter(services, ledger)
        assert reconcile(meter) == 1 and reconcile(meter) == 0
        entry = ledger.entry(done)
        assert entry is not None and (entry.prefill_gpu_s, entry.decode_gpu_s) == (0.2, pytest.approx(0.3))
        assert entry.total_usd == pytest.approx(0.5 / 3600 * 3.5)
        (wasted,) = ledger.wasted(failed)
        assert (wasted.phase, wasted.region, wasted.usd_per_gpu_h) == ("prefill", "prefill-a", 0.6)  # spot price
        assert wasted.gpu_s == pytest.approx(0.2, abs=0.15) and ledger.entry(failed) is None
        assert jobs.spend(tenant_id) == pytest.approx(entry.total_usd)  # budgets see the swept bill
    finally:
        ledger.close()
        services.close()


def test_budget_is_enforced_from_the_ledger(metered: Metered) -> None:
    """A job reserves its predicted $ at admission; its bill (the ledger entry) replaces the reservation in the
    spend; once the spend reaches the budget, admission refuses (402) before tokenizing."""
    m = metered
    tenant_id, key = m.stack.tenant("gamma", budget_usd=1.0)
    m.keys["gamma"], m.ids["gamma"] = key, tenant_id
    client = openai.OpenAI(base_url=m.stack.url + "/v1", api_key=key, max_retries=0, timeout=60)
    first = client.completions.create(model="tiny-llama", prompt=[5, 6, 7], max_tokens=4)
    m.jobs["gamma"] = [first.id]
    wait_billed(m)
    entry = next(e for e in m.entries() if e.job_id == first.id)

    def tenant() -> dict[str, float]:
        tenants = httpx.get(m.stack.url + "/admin/tenants", headers=ADMIN, timeout=5).json()
        return next(t for t in tenants if t["id"] == tenant_id)  # type: ignore[no-any-return]

    wait_until(lambda: tenant()["reserved_usd"] == 0, 10, 0.05)  # settled: the bill replaced the prediction
    assert tenant()["spend_usd_this_month"] == pytest.approx(entry.total_usd)  # billed once
    patch = {"budget_usd": entry.total_usd}  # the budget is now exactly what was spent
    httpx.patch(f"{m.stack.url}/admin/tenants/{tenant_id}", json=patch, headers=ADMIN, timeout=5).raise_for_status()
    with pytest.raises(openai.APIStatusError) as info:
        client.completions.create(model="tiny-llama", prompt=[5, 6, 7], max_tokens=4)
    assert (info.value.status_code, info.value.type, info.value.code) == (402, "insufficient_quota", "budget_exhausted")
    assert tenant()["spend_usd_this_month"] == pytest.approx(entry.total_usd)


def test_metering_metrics(metered: Metered) -> None:
    text = httpx.get(metered.stack.url + "/metrics", headers=ADMIN, timeout=5).text
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    assert samples['prfaas_billed_usd_total{phase="prefill",region="prefill-a"}'] > 0
    assert samples['prfaas_billed_usd_total{phase="egress",region="prefill-a"}'] > 0
    splits = sum(1 for e in metered.entries() if e.placement == "split")  # all billed by the API process
    assert samples['prfaas_billed_jobs_total{placement="split"}'] == splits >= 2
    assert samples['prfaas_price_usd_per_gpu_hour{market="on-demand",region="decode-b",source="table"}'] == 3.5
    assert samples['prfaas_price_stale{market="spot",region="prefill-a"}'] == 0
    billing = [name for name in samples if not name.startswith("prfaas_job_")]  # the stage histograms: jobs/latency.py
    assert not any("tenant=" in name for name in billing)  # bounded labels: no tenant, no job
    writes = samples["prfaas_ledger_write_seconds_count"]
    assert writes >= len(metered.jobs["alpha"]) + len(metered.jobs["beta"])
    print(f"ledger writes: {writes:.0f}, mean {samples['prfaas_ledger_write_seconds_sum'] / writes * 1000:.1f} ms each")


def test_a_job_that_cannot_be_priced_stops_no_other_job_of_the_sweep(
    metered: Metered, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A DONE job of a region that is gone with its price (no table entry, no registration) cannot be billed:
    the sweep logs it and goes on, so a job the meter missed after it is still billed."""
    m = metered
    monkeypatch.setenv("PRFAAS_PRICES_PATH", m.stack.env["PRFAAS_PRICES_PATH"])
    services = Services.create(stack_settings(m.stack))
    ledger = Ledger(m.stack.ledger_url)
    try:
        tenant_id, _ = m.stack.tenant("epsilon")
        ids = [_done_locally(services, tenant_id, "gone-region")]  # the sweep meets the unpriced one first
        time.sleep(0.01)
        ids.append(_done_locally(services, tenant_id, "decode-b"))
        meter = Meter(services, ledger)
        assert reconcile(meter) >= 1
        assert ledger.entry(ids[0]) is None and ledger.entry(ids[1]) is not None
    finally:
        ledger.close()
        services.close()
