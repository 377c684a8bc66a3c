"""A job its client cancels mid-answer is billed for the work up to the cut (docs/metering.md, "A job its client
cancels"), on metering_kit's stack: a client that closes its stream after a few tokens, and a tenant that cancels
a split job with `DELETE /v1/jobs/{id}` while another request streams it. Before, both were billed nothing: the
client had every token it read for free. The sweep bills such a job the meter missed, and a job the platform
canceled is still its own cost."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import httpx
import pytest
from cp_kit import stack_settings
from metering_kit import EGRESS_USD_PER_GB, PRICES, SPLIT_TOKENS, Metered

from prfaas.control_plane.billing.ledger import Ledger
from prfaas.control_plane.billing.meter import Meter
from prfaas.control_plane.billing.models import UsageEntry
from prfaas.control_plane.billing.reconcile import CUT_GRACE_S, reconcile
from prfaas.control_plane.jobs.generation import Follower
from prfaas.control_plane.jobs.states import JobState
from prfaas.control_plane.jobs.tokenlog import Outputs, Token
from prfaas.control_plane.services import Services
from prfaas.control_plane.tenants import Quota
from prfaas.devstack.stack import ADMIN, wait_until
from prfaas.engine.hf import HFEngine

pytestmark = pytest.mark.e2e
MAX_TOKENS = 400  # far more than the test reads before it cuts: the cut lands mid-answer


def _read(lines: Iterator[str], chunks: int) -> int:
    """Reads `chunks` text chunks of a streamed completion's `lines`, then stops; -> how many it read."""
    read = 0
    for line in lines:
        if line.startswith("data: {") and json.loads(line[6:]).get("choices"):
            read += 1
            if read >= chunks:
                break
    return read


def _billed(m: Metered, job_id: str) -> UsageEntry:
    ledger = m.ledger()
    try:
        wait_until(lambda: ledger.entry(job_id) is not None, 20, 0.1)
        entry = ledger.entry(job_id)
        assert entry is not None and ledger.wasted(job_id) == []  # one attempt, the one billed
        return entry
    finally:
        ledger.close()


def _spend(m: Metered, tenant_id: str) -> float:
    tenants = httpx.get(m.stack.url + "/admin/tenants", headers=ADMIN, timeout=5).json()
    return float(next(t for t in tenants if t["id"] == tenant_id)["spend_usd_this_month"])


def _job(m: Metered, key: str, job_id: str) -> dict[str, object]:
    headers = {"Authorization": f"Bearer {key}"}
    return dict(httpx.get(f"{m.stack.url}/v1/jobs/{job_id}", headers=headers, timeout=5).json())


def test_a_stream_its_client_closes_is_billed_for_the_tokens_it_got(metered: Metered) -> None:
    m = metered
    tenant_id, key = m.stack.tenant("cutter", allow_placement=True)
    body = {"model": "tiny-llama", "prompt": [5, 6, 7, 8, 9], "max_tokens": MAX_TOKENS, "ignore_eos": True,
            "stream": True, "prfaas": {"placement": "local"}}  # fmt: skip
    headers = {"Authorization": f"Bearer {key}"}
    with httpx.stream("POST", m.stack.url + "/v1/completions", json=body, headers=headers, timeout=60) as reply:
        job_id, read = reply.headers["X-Prfaas-Job-Id"], _read(reply.iter_lines(), 3)  # then the client hangs up
    entry = _billed(m, job_id)
    job = _job(m, key, job_id)
    assert job["state"] == "CANCELED" and job["error"] == "canceled: client disconnected"
    assert read == 3 and 3 <= entry.tokens_out < MAX_TOKENS, entry.tokens_out
    assert job["usage"]["completion_tokens"] == entry.tokens_out  # type: ignore[index]
    assert (entry.placement, entry.decode_region, entry.attempts) == ("local", "decode-b", 1)
    assert entry.prefill_gpu_s > 0 and entry.decode_gpu_s > 0 and entry.ttft_s is not None
    price = PRICES["decode-b"]["usd_per_gpu_hour"]
    assert entry.total_usd == pytest.approx((entry.prefill_gpu_s + entry.decode_gpu_s) / 3600 * price, rel=1e-9)
    wait_until(lambda: _spend(m, tenant_id) > 0, 10, 0.1)
    assert _spend(m, tenant_id) == pytest.approx(entry.total_usd)  # the budget counts it, once


def test_a_split_job_its_tenant_cancels_mid_stream_is_billed_with_its_egress(metered: Metered, long_text: str) -> None:
    """`DELETE /v1/jobs/{id}` from one request while another streams the job: the streaming request records what
    it got when its stream ends, the cancel's request had queued the bill first; whichever is second bills it."""
    m = metered
    tenant_id, key = m.stack.tenant("deleter", allow_placement=True)
    prompt = HFEngine("tiny-llama").encode(long_text)[1000 : 1000 + SPLIT_TOKENS]
    body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True,
            "prfaas": {"placement": "split"}}  # fmt: skip
    headers = {"Authorization": f"Bearer {key}"}
    with httpx.stream("POST", m.stack.url + "/v1/completions", json=body, headers=headers, timeout=60) as reply:
        job_id, lines = reply.headers["X-Prfaas-Job-Id"], reply.iter_lines()
        assert _read(lines, 3) == 3
        canceled = httpx.delete(f"{m.stack.url}/v1/jobs/{job_id}", headers=headers, timeout=10)
        assert canceled.status_code == 200 and canceled.json()["state"] == "CANCELED", canceled.text
        rest = list(lines)  # the stream ends: an error event, then [DONE]
    assert any("job canceled" in line for line in rest) and [x for x in rest if x][-1] == "data: [DONE]"
    entry = _billed(m, job_id)
    assert (entry.placement, entry.prefill_region, entry.decode_region) == ("split", "prefill-a", "decode-b")
    assert 3 <= entry.tokens_out < MAX_TOKENS and entry.kv_bytes_wire > 0 and entry.prefill_gpu_s > 0
    assert entry.egress_usd_per_gb == EGRESS_USD_PER_GB and entry.decode_gpu_s > 0
    assert _job(m, key, job_id)["usage"]["completion_tokens"] == entry.tokens_out  # type: ignore[index]
    wait_until(lambda: _spend(m, tenant_id) > 0, 10, 0.1)
    assert _spend(m, tenant_id) == pytest.approx(entry.total_usd)


QUOTA = Quota(rps=100, concurrency=100, budget_usd=100)


@pytest.fixture
def swept(metered: Metered, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Services, Ledger]]:
    """The stack's job store and ledger, for jobs written here and the sweeps run on them (the stack's prices)."""
    monkeypatch.setenv("PRFAAS_PRICES_PATH", metered.stack.env["PRFAAS_PRICES_PATH"])
    services = Services.create(stack_settings(metered.stack))
    ledger = Ledger(metered.stack.ledger_url)
    yield services, ledger
    ledger.close()
    services.close()


def _local(services: Services, tenant_id: str) -> str:
    """A job running locally in decode-b."""
    jobs = services.jobs
    job = jobs.create(tenant_id, {"model": "tiny-llama", "prompt_tokens": 5, "max_new_tokens": 50}, QUOTA).job_id
    jobs.update(job, 1, placement_chosen="local", decode_region="decode-b", prefill_region="decode-b")
    jobs.transition(job, JobState.LOCAL, 1, note="local in decode-b")
    return job


def _canceled_locally(services: Services, tenant_id: str, *, by_client: bool, cut: bool) -> str:
    """A job run locally in decode-b and canceled (`by_client` or by the platform), with its follower's record of
    3 tokens (`cut`) or none, and no `job_done` (its API process died)."""
    jobs = services.jobs
    job = _local(services, tenant_id)
    time.sleep(0.05)
    marked = {"client_canceled": 1} if by_client else {}
    jobs.transition(job, JobState.CANCELED, 0, note="x", error="canceled: x", **marked)
    if cut:  # its token 0 came a second before the cancel
        jobs.update(job, 1, cut_tokens=3, cut_first_at=time.time() - 1.0, cut_first_s=0.2, cut_last_s=0.5)
    return job


def test_the_sweep_bills_a_cut_job_the_meter_missed_and_leaves_platform_cancels_as_waste(
    metered: Metered, swept: tuple[Services, Ledger], monkeypatch: pytest.MonkeyPatch
) -> None:
    m, (services, ledger) = metered, swept
    tenant_id, _ = m.stack.tenant("swept-cuts")
    cut = _canceled_locally(services, tenant_id, by_client=True, cut=True)
    platform = _canceled_locally(services, tenant_id, by_client=False, cut=True)  # its deadline, say
    pending = _canceled_locally(services, tenant_id, by_client=True, cut=False)  # its follower may still record
    meter = Meter(services, ledger)
    assert reconcile(meter) == 1 and reconcile(meter) == 0
    entry = ledger.entry(cut)
    assert entry is not None and (entry.tokens_out, entry.prefill_gpu_s) == (3, 0.2)
    assert entry.decode_gpu_s == pytest.approx(0.3) and ledger.wasted(cut) == []
    assert ledger.entry(platform) is None and [w.phase for w in ledger.wasted(platform)] == ["local"]
    assert ledger.entry(pending) is None and ledger.wasted(pending) == []
    assert services.jobs.spend(tenant_id) == pytest.approx(entry.total_usd)
    # no record within the grace: canceled before its first token came, the platform's cost
    monkeypatch.setattr("prfaas.control_plane.billing.reconcile.CUT_GRACE_S", 0.0)
    assert CUT_GRACE_S > 0 and reconcile(meter) == 0
    assert ledger.entry(pending) is None and [w.phase for w in ledger.wasted(pending)] == ["local"]
    # its follower's record after that (a stalled process): refused, so the attempt is not billed as well
    late = Outputs(())
    late.add(Token(0, 7, False, ""))
    late.timed(1, (time.time(), 0.2), 0.5)
    Follower(services, None)._cut(pending, late)
    assert "cut_tokens" not in services.jobs.get(pending) and reconcile(meter) == 0
    assert ledger.entry(pending) is None and services.jobs.spend(tenant_id) == pytest.approx(entry.total_usd)


def test_a_cancel_before_the_first_token_where_the_job_streams_bills_no_token_that_comes_after(
    metered: Metered, swept: tuple[Services, Ledger], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The client leaves before the job's first token reached the API process that streams it: the cancel closes
    the job's record, so tokens that were already on their way (recorded when the stream ends) are not billed, and
    the job is the platform's cost as any job canceled before its first token."""
    m, (services, ledger) = metered, swept
    tenant_id, _ = m.stack.tenant("early-cut")
    jobs = services.jobs
    job = _local(services, tenant_id)
    follower = Follower(services, None)
    streamed = follower._streamed[job] = Outputs(())  # this process streams it: no token yet
    assert follower.cancel(job, "client disconnected", wait=False, by_client=True)
    streamed.add(Token(0, 7, False, ""))  # then two tokens that were in flight
    streamed.add(Token(1, 8, False, ""))
    streamed.timed(1, (time.time(), 0.2), 0.3)
    follower._cut(job, streamed)
    record = jobs.get(job)
    assert "cut_tokens" not in record and record["cut_closed"] == "1", record
    monkeypatch.setattr("prfaas.control_plane.billing.reconcile.CUT_GRACE_S", 0.0)
    meter = Meter(services, ledger)
    assert reconcile(meter) == 0 and ledger.entry(job) is None
    assert [w.phase for w in ledger.wasted(job)] == ["local"]


def test_a_record_whose_first_token_came_after_the_cancel_is_swept_as_waste(
    metered: Metered, swept: tuple[Services, Ledger]
) -> None:
    """Recorded by a follower the cancel did not reach, its first token after the cancel: not billable, and the
    sweep records it as the platform's cost (it reads what `billable` needs: before, it took the job for billable
    on the fields it read, the biller skipped it, and no sweep ever recorded it)."""
    m, (services, ledger) = metered, swept
    tenant_id, _ = m.stack.tenant("late-first")
    job = _canceled_locally(services, tenant_id, by_client=True, cut=True)  # its first token: a second ago
    services.jobs.update(job, 1, canceled_at=time.time() - 2.0)  # the cancel: before that
    meter = Meter(services, ledger)
    assert reconcile(meter) == 0 and ledger.entry(job) is None
    assert [w.phase for w in ledger.wasted(job)] == ["local"]
