"""A job's life through the faults no other test walks (issue 22), on real processes: the API,
one Celery worker of concurrency 2, a prefill region that takes 3 s a prompt (`test_layer_delay_s`
0.75 s x 4 layers of tiny-llama) with a dispatch visibility timeout of 1 s, and a decode region
of two instances that pace their tokens (`test_token_delay_s`), so a test can act mid-stream."""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
import redis
from cp_kit import two_region_stack

from prfaas.control_plane.billing.ledger import Ledger
from prfaas.devstack.stack import ADMIN, REDIS_URL, Stack, wait_until
from prfaas.engine.hf import HFEngine
from prfaas.engine.sampling import SamplingParams
from prfaas.engine.stops import output_text

pytestmark = pytest.mark.e2e
LAYER_DELAY_S = 0.75  # 4 layers: 3 s a prefill, 3x the visibility timeout
TOKEN_DELAY_S = 0.1
SPLIT = {"prfaas": {"placement": "split"}}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    for s in two_region_stack(
        tmp_path_factory.mktemp("cp-lifecycle"), test_layer_delay_s=LAYER_DELAY_S,
        env={"PRFAAS_DISPATCH_VISIBILITY_S": "1"}, worker_concurrency=2,
        decode_fields={"instance": "d1", "test_token_delay_s": TOKEN_DELAY_S},
    ):  # fmt: skip
        s.region("decode-b", "decode", 4.0, instance="d2", test_token_delay_s=TOKEN_DELAY_S)
        wait_until(lambda s=s: _instances(s, "decode-b") == 2, 20, 0.1)  # type: ignore[misc]
        yield s


def _instances(stack: Stack, region: str) -> int:
    regions = httpx.get(stack.url + "/admin/regions", headers=ADMIN, timeout=5).json()
    found = [r for r in regions if r["name"] == region]
    return sum(1 for i in found[0]["instances"] if i["healthy"]) if found else 0


def _job(stack: Stack, key: str, job_id: str) -> dict[str, object]:
    reply: dict[str, object] = httpx.get(
        f"{stack.url}/v1/jobs/{job_id}", headers={"Authorization": f"Bearer {key}"}, timeout=5
    ).json()
    return reply


def _states(record: dict[str, object]) -> list[tuple[str, int]]:
    timeline = record["timeline"]
    assert isinstance(timeline, list)
    return [(e["state"], e["attempt"]) for e in timeline]


def _reference(prompt: list[int], tokens: int) -> str:
    engine = HFEngine("tiny-llama")
    return output_text(engine.decode_text, engine.generate(prompt, SamplingParams(max_new_tokens=tokens)))


def test_a_prefill_three_times_the_visibility_timeout_completes_in_one_attempt(stack: Stack, long_text: str) -> None:
    _, key = stack.tenant("slow-prefill", allow_placement=True)
    prompt = HFEngine("tiny-llama").encode(long_text)[:400]
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key=key, max_retries=0, timeout=60)
    started = time.monotonic()
    reply = client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=4, extra_body=SPLIT)
    assert time.monotonic() - started > 3 * 1.0  # the prefill alone took 3x the visibility timeout
    assert reply.choices[0].text == _reference(prompt, 4)
    states = _states(_job(stack, key, reply.id))
    assert {attempt for _, attempt in states} == {1}, states  # never redelivered, never restarted
    assert [s for s, _ in states] == ["QUEUED", "PREFILLING", "TRANSFERRING", "DECODING", "DONE"], states


def test_a_decode_instance_killed_mid_stream_the_client_text_equals_an_undisturbed_run(
    stack: Stack, long_text: str
) -> None:
    _, key = stack.tenant("decode-kill", allow_placement=True)
    prompt = HFEngine("tiny-llama").encode(long_text)[:400]
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key=key, max_retries=0, timeout=90)
    stream = client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=40, stream=True,
                                       extra_body=SPLIT)  # fmt: skip
    pieces, job_id, killed = [], "", None
    for chunk in stream:
        job_id = chunk.id
        pieces.append(chunk.choices[0].text if chunk.choices else "")
        if len(pieces) == 5 and killed is None:  # mid-stream: kill the instance serving it
            record = _job(stack, key, job_id)
            killed = next(r for r in stack.regions if r.name == "decode-b" and r.instance == record["decode_instance"])
            killed.proc.send_signal(signal.SIGKILL)
            killed.proc.wait(5)
    assert killed is not None
    try:
        assert "".join(pieces) == _reference(prompt, 40)  # not a token repeated, none skipped
        record = _job(stack, key, job_id)
        states = _states(record)
        assert states[-1] == ("DONE", 2) and ("QUEUED", 2) in states, states
        notes = [e["note"] for e in record["timeline"] if e["attempt"] == 2]  # type: ignore[union-attr]
        assert any(str(n).startswith("reship from prefill-a/") for n in notes), notes  # KV reshipped, not recomputed
        assert record["decode_instance"] != killed.instance
    finally:
        stack.regions.remove(killed)
        stack.region("decode-b", "decode", 4.0, instance=killed.instance, test_token_delay_s=TOKEN_DELAY_S)
        wait_until(lambda: _instances(stack, "decode-b") == 2, 30, 0.1)


def _sse_text(reply: httpx.Response, stop_after: int | None = None) -> tuple[str, str, int]:
    """(text, job id, chunks read) of a streamed completion; stops reading after `stop_after` chunks."""
    text, chunks = "", 0
    for line in reply.iter_lines():
        if not line.startswith("data: {"):
            continue
        chunk = json.loads(line[6:])
        text += chunk["choices"][0]["text"] if chunk.get("choices") else ""
        chunks += 1
        if stop_after is not None and chunks >= stop_after:
            break
    return text, reply.headers["X-Prfaas-Job-Id"], chunks


def test_two_requests_with_one_idempotency_key_share_one_job_one_bill_one_text(stack: Stack, long_text: str) -> None:
    tenant_id, key = stack.tenant("idem", allow_placement=True)
    prompt = HFEngine("tiny-llama").encode(long_text)[:400]
    body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": 20, "prfaas": {"placement": "split"}}
    headers = {"Authorization": f"Bearer {key}", "Idempotency-Key": "retry-1"}
    results: dict[str, tuple[str, str]] = {}

    def ask(name: str) -> None:  # the same body: a retry (another body under the key is a 422)
        reply = httpx.post(stack.url + "/v1/completions", json=body, headers=headers, timeout=60).json()
        results[name] = (reply["choices"][0]["text"], reply["id"])

    first = threading.Thread(target=ask, args=("first",))
    first.start()
    time.sleep(1.0)  # the first one's job is prefilling: the second comes while it runs
    second = threading.Thread(target=ask, args=("second",))
    second.start()
    first.join(60)
    second.join(60)
    expected = _reference(prompt, 20)
    assert results["first"] == results["second"] and results["first"][0] == expected, results
    job_id = results["first"][1]
    jobs = httpx.get(stack.url + "/v1/jobs", headers=headers, timeout=5).json()["data"]
    assert [j["id"] for j in jobs] == [job_id]  # one job
    states = _states(_job(stack, key, job_id))
    assert states.count(("DONE", 1)) == 1 and {a for _, a in states} == {1}, states  # one run, never restarted
    ledger = Ledger(stack.ledger_url, migrate=False)
    try:
        wait_until(lambda: ledger.entry(job_id) is not None, 10, 0.05)
        entry = ledger.entry(job_id)
        assert entry is not None and entry.attempts == 1
        tenants = httpx.get(f"{stack.url}/admin/tenants", headers=ADMIN, timeout=5).json()
        spend = next(t for t in tenants if t["id"] == tenant_id)["spend_usd_this_month"]
        assert spend == pytest.approx(entry.total_usd, rel=1e-9)  # one bill
    finally:
        ledger.close()


def test_the_first_stream_going_away_does_not_cancel_a_job_a_retry_still_reads(stack: Stack, long_text: str) -> None:
    _, key = stack.tenant("idem-disconnect", allow_placement=True)
    prompt = HFEngine("tiny-llama").encode(long_text)[:400]
    body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": 30, "stream": True, "prfaas": {"placement": "split"}}
    headers = {"Authorization": f"Bearer {key}", "Idempotency-Key": "retry-2"}
    url = stack.url + "/v1/completions"
    with (
        httpx.stream("POST", url, json=body, headers=headers, timeout=60) as first,
        httpx.stream("POST", url, json=body, headers=headers, timeout=60) as retry,
    ):
        _, job_id, read = _sse_text(first, stop_after=3)  # then the first client hangs up
        first.close()
        text, retry_job, _ = _sse_text(retry)
    assert read == 3 and retry_job == job_id
    assert text == _reference(prompt, 30)  # the retry got every token
    record = _job(stack, key, job_id)
    assert record["state"] == "DONE", record


def test_an_api_process_killed_with_jobs_in_flight_ends_them_with_a_reason_and_frees_the_tenant(
    stack: Stack, long_text: str
) -> None:
    """Last: it replaces the stack's API process. Three jobs in flight; the one asked with an
    Idempotency-Key is adopted by the worker and its client's retry reads all of it; the others
    end FAILED naming the dead process."""
    tenant, key = stack.tenant("api-kill", allow_placement=True)
    prompt = HFEngine("tiny-llama").encode(long_text)[:400]
    url = stack.url
    body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": 60, "stream": True}

    def ask(placement: str, idempotency_key: str) -> None:
        headers = {"Authorization": f"Bearer {key}"} | ({"Idempotency-Key": idempotency_key} if idempotency_key else {})
        try:
            with httpx.stream("POST", url + "/v1/completions", json=body | {"prfaas": {"placement": placement}},
                              headers=headers, timeout=60) as reply:  # fmt: skip
                for _ in reply.iter_lines():
                    pass
        except httpx.HTTPError:
            pass  # the API died under it

    asked = [("split", "kept"), ("split", ""), ("local", "")]
    callers = [threading.Thread(target=ask, args=a, daemon=True) for a in asked]
    for call in callers:
        call.start()
    client = redis.Redis.from_url(REDIS_URL)
    active = f"{stack.prefix}:tenant:{tenant}:active"
    wait_until(lambda: client.scard(active) == 3, 10, 0.05)
    time.sleep(2.0)  # jobs decoding, or prefilling
    assert stack.api is not None
    stack.api.send_signal(signal.SIGKILL)
    stack.api.wait(5)
    killed_at = time.monotonic()
    stack.start_api()  # as its supervisor would (the regions beat to it again)
    job_ids = [j.decode() for j in client.zrange(f"{stack.prefix}:tenant:{tenant}:jobs", 0, -1)]
    assert len(job_ids) == 3

    def job(job_id: str) -> dict[str, str]:
        return {k.decode(): v.decode() for k, v in client.hgetall(f"{stack.prefix}:job:{job_id}").items()}

    wait_until(lambda: all(job(j)["state"] in ("DONE", "FAILED") for j in job_ids), 30, 0.2)
    assert time.monotonic() - killed_at < 30
    assert client.scard(active) == 0
    kept = [job(j) for j in job_ids if job(j).get("idempotent")]
    others = [job(j) for j in job_ids if not job(j).get("idempotent")]
    timelines = {j: client.lrange(f"{stack.prefix}:job:{j}:timeline", 0, -1) for j in job_ids}
    assert len(kept) == 1 and kept[0]["state"] == "DONE", (kept, timelines)  # adopted: decoded to its end
    for record in others:
        assert record["state"] == "DONE" or "API process" in record.get("error", ""), record
    for job_id in job_ids:
        timeline = [json.loads(e) for e in client.lrange(f"{stack.prefix}:job:{job_id}:timeline", 0, -1)]
        assert timeline[-1]["state"] == job(job_id)["state"]
    client.close()
    headers = {"Authorization": f"Bearer {key}", "Idempotency-Key": "kept"}  # the client retries
    with httpx.stream("POST", stack.url + "/v1/completions", json=body | {"prfaas": {"placement": "split"}},
                      headers=headers, timeout=60) as reply:  # fmt: skip
        text, job_id, _ = _sse_text(reply)
    assert job_id == kept[0]["id"] and text == _reference(prompt, 60)


BATCH = {"model": "tiny-llama", "prompt": ["hello there", "general kenobi"], "max_tokens": 60, "ignore_eos": True}


def _wait_states(stack: Stack, key: str, job_ids: list[str], timeout_s: float) -> list[str]:
    ended = ("DONE", "CANCELED", "FAILED")
    wait_until(lambda: all(_job(stack, key, j)["state"] in ended for j in job_ids), timeout_s, 0.1)
    return [str(_job(stack, key, j)["state"]) for j in job_ids]


def test_a_streamed_batch_whose_one_job_ends_cancels_the_others(stack: Stack) -> None:
    """One prompt's job is canceled mid-stream: the stream ends with its error and the other prompt's job is
    canceled too (before, it was left running for no one, and could hold the tenant's concurrency slot for
    good), long before its 60 tokens at 0.1 s would have ended it."""
    _tenant, key = stack.tenant("batch-stream", concurrency=2)
    headers = {"Authorization": f"Bearer {key}"}
    with httpx.stream("POST", stack.url + "/v1/completions", json=BATCH | {"stream": True}, headers=headers,
                      timeout=60) as response:  # fmt: skip
        job_ids = response.headers["x-prfaas-job-id"].split(",")
        events: list[str] = []
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line)
                if len(events) == 3:
                    httpx.delete(f"{stack.url}/v1/jobs/{job_ids[0]}", headers=headers, timeout=5)
    assert "job_canceled" in events[-2] and events[-1] == "data: [DONE]"
    assert _wait_states(stack, key, job_ids, 3.0) == ["CANCELED", "CANCELED"]


def test_a_batch_whose_one_job_ends_answers_at_once_and_cancels_the_others(stack: Stack) -> None:
    """Not streamed: the 409 comes as the canceled job ends, and the other job is canceled, not run to its end
    and billed (before, the answer waited for the other prompt's whole decode)."""
    _tenant, key = stack.tenant("batch", concurrency=2)
    headers = {"Authorization": f"Bearer {key}"}
    answer: dict[str, httpx.Response] = {}
    caller = threading.Thread(target=lambda: answer.update(
        r=httpx.post(stack.url + "/v1/completions", json=BATCH, headers=headers, timeout=60)))  # fmt: skip
    caller.start()
    listed = lambda: [j["id"] for j in httpx.get(stack.url + "/v1/jobs", headers=headers, timeout=5).json()["data"]]  # noqa: E731
    wait_until(lambda: len(listed()) == 2, 20, 0.1)
    time.sleep(0.5)  # both decoding
    job_ids = listed()
    canceled = time.monotonic()
    httpx.delete(f"{stack.url}/v1/jobs/{job_ids[0]}", headers=headers, timeout=5)
    caller.join(30)
    assert answer["r"].status_code == 409 and time.monotonic() - canceled < 3.0
    assert sorted(_wait_states(stack, key, job_ids, 3.0)) == ["CANCELED", "CANCELED"]
