"""Faults around a running job, on real processes (devstack/stack.py): the API, a Celery
worker, a prefill and a decode region (tiny-llama), real Redis, the official openai client.
A stack of its own, so the regions' gauges (KV bytes held, leases) start at zero; its prefill
region is slowed by the test-only `test_layer_delay_s` (0.5 s a layer: ~2 s a prefill)."""

from __future__ import annotations

import json
import signal
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from cp_kit import two_region_stack

from prfaas.control_plane.billing.ledger import Ledger
from prfaas.devstack.stack import ADMIN, Stack, wait_until
from prfaas.engine.hf import HFEngine
from prfaas.engine.sampling import SamplingParams
from prfaas.engine.stops import output_text

pytestmark = pytest.mark.e2e
LAYER_DELAY_S = 0.5
KEEPALIVE_S = 0.5  # under the prefill's ~2 s: a stream gets keep-alives before its first token


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    folder = tmp_path_factory.mktemp("cp-faults")
    env = {"PRFAAS_SSE_KEEPALIVE_S": str(KEEPALIVE_S)}
    yield from two_region_stack(folder, env=env, test_layer_delay_s=LAYER_DELAY_S)


@pytest.fixture(scope="module")
def key(stack: Stack) -> str:
    return stack.tenant("acme", allow_placement=True)[1]


def metric(address: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` in a region's /metrics whose labels include `labels`."""
    total = 0.0
    for line in httpx.get(f"http://{address}/metrics", timeout=5).text.splitlines():
        sample, _, value = line.rpartition(" ")
        if sample == name or (sample.startswith(name + "{") and all(f'{k}="{v}"' in sample for k, v in labels.items())):
            total += float(value)
    return total


def job(stack: Stack, key: str, job_id: str) -> dict[str, object]:
    reply: dict[str, object] = httpx.get(
        f"{stack.url}/v1/jobs/{job_id}", headers={"Authorization": f"Bearer {key}"}, timeout=5
    ).json()
    return reply


def listed(stack: Stack, key: str) -> list[dict[str, object]]:
    """The tenant's jobs, newest first."""
    headers = {"Authorization": f"Bearer {key}"}
    jobs: list[dict[str, object]] = httpx.get(f"{stack.url}/v1/jobs", headers=headers, timeout=5).json()["data"]
    return jobs


def split_in_background(
    stack: Stack, key: str, prompt: list[int], timeout_s: float
) -> tuple[threading.Thread, list[openai.types.Completion]]:
    """A 6-token split completion asked on a thread of its own; returns once its job is PREFILLING (the
    tenant's only job), with the thread and the list its reply lands in."""
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key=key, max_retries=0, timeout=timeout_s)
    replies: list[openai.types.Completion] = []
    split = {"prfaas": {"placement": "split"}}
    call = threading.Thread(
        target=lambda: replies.append(
            client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=6, extra_body=split)
        ),
        daemon=True,
    )
    call.start()
    wait_until(lambda: [j["state"] for j in listed(stack, key)] == ["PREFILLING"], 10, 0.02)
    return call, replies


def retried_once_and_answered(
    stack: Stack,
    key: str,
    job_id: str,
    call: threading.Thread,
    replies: list[openai.types.Completion],
    prompt: list[int],
    wait_s: float,
) -> dict[str, object]:
    """Once the call returns: it answered with what a colocated run gives, and the job's timeline shows attempt
    1 prefilling, attempt 2 queued and DONE once, by attempt 2. Returns the job's record."""
    call.join(wait_s)
    assert replies, "the completion did not return"
    engine = HFEngine("tiny-llama")
    expected = engine.generate(prompt, SamplingParams(max_new_tokens=6))
    assert replies[0].id == job_id and replies[0].choices[0].text == output_text(engine.decode_text, expected)
    record = job(stack, key, job_id)
    timeline = record["timeline"]
    assert isinstance(timeline, list)
    states = [(e["state"], e["attempt"]) for e in timeline]
    assert ("PREFILLING", 1) in states and ("QUEUED", 2) in states and states[-1] == ("DONE", 2), states
    assert sum(1 for state, _ in states if state == "DONE") == 1, states
    return record


def test_client_disconnect_mid_stream_cancels_the_job_in_both_regions(stack: Stack, key: str, long_text: str) -> None:
    prefill, decode = stack.regions
    prompt = HFEngine("tiny-llama").encode(long_text)[:600]
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key=key, max_retries=0, timeout=30)
    # 3000 tokens take the decode region ~4 s (~750 tokens/s): the stream is cut well before its end
    stream = client.completions.create(
        model="tiny-llama", prompt=prompt, max_tokens=3000, stream=True, extra_body={"prfaas": {"placement": "split"}}
    )
    chunks = [next(stream) for _ in range(5)]
    job_id = chunks[0].id
    assert job(stack, key, job_id)["state"] == "DECODING"
    assert metric(decode.metrics, "prfaas_decode_kv_used_bytes") > 0  # the reservation holds the prompt's KV
    assert metric(prefill.metrics, "prfaas_prefill_kv_leases") == 1  # kept 30 s for a re-shipment
    ended = "prfaas_decode_reservations_ended_total"
    ended_before, done_before = metric(decode.metrics, ended), metric(decode.metrics, ended, outcome="done")

    stream.close()  # the client goes away mid-stream

    canceled_s = wait_until(lambda: job(stack, key, job_id)["state"] == "CANCELED", 10, 0.02)
    print(f"canceled {canceled_s:.3f} s after the disconnect")
    assert canceled_s < 1.0  # at once, not when the garbage collector reaches the stream's generator
    wait_until(lambda: metric(decode.metrics, "prfaas_decode_kv_used_bytes") == 0, 5, 0.05)
    assert metric(decode.metrics, "prfaas_decode_reservations") == 0
    assert metric(prefill.metrics, "prfaas_prefill_kv_leases") == 0  # released by Cancel, not by the 30 s lease
    # ended by the Cancel RPC or, when it comes first, by the API's Decode stream being dropped: not "done"
    assert metric(decode.metrics, ended) == ended_before + 1
    assert metric(decode.metrics, ended, outcome="done") == done_before
    record = job(stack, key, job_id)
    timeline = record["timeline"]
    assert isinstance(timeline, list) and timeline[-1]["state"] == "CANCELED", timeline
    assert "client disconnected" in str(record.get("error")), record
    tokens = metric(decode.metrics, "prfaas_decode_tokens_total")
    time.sleep(0.5)
    assert metric(decode.metrics, "prfaas_decode_tokens_total") == tokens  # decoding stopped


@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
def test_a_stream_waiting_for_its_first_token_gets_keep_alives_the_client_skips(
    stack: Stack, key: str, endpoint: str
) -> None:
    """A split job's prefill takes ~2 s here: the stream sends `: keep-alive` comments (`sse_keepalive_s`) until
    its first token, so a proxy's idle timeout does not cut it; a chat's role chunk comes with its first token, as
    vLLM sends it (before, at once: a client's time to first chunk was not its time to first token). The official
    client reads the same text as a stream=false request."""
    body: dict[str, Any] = {"model": "tiny-llama", "max_tokens": 4, "prfaas": {"placement": "split"}}
    if endpoint == "completions":
        body["prompt"] = "The keep-alive test"
    else:
        body["messages"] = [{"role": "user", "content": "The keep-alive test"}]
    lines: list[str] = []
    with httpx.stream("POST", f"{stack.url}/v1/{endpoint}", json=body | {"stream": True},
                      headers={"Authorization": f"Bearer {key}"}, timeout=30) as reply:  # fmt: skip
        assert reply.status_code == 200
        lines = [line for line in reply.iter_lines() if line]
    first = next(i for i, line in enumerate(lines) if line.startswith("data:"))
    assert first >= 2 and set(lines[:first]) == {": keep-alive"}, lines[: first + 1]
    assert ": keep-alive" not in lines[first:] and lines[-1] == "data: [DONE]", lines
    if endpoint != "completions":
        return
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key=key, max_retries=0, timeout=30)
    split = {"prfaas": {"placement": "split"}}
    streamed = client.completions.create(model="tiny-llama", prompt=body["prompt"], max_tokens=4, stream=True,
                                         extra_body=split)  # fmt: skip
    text = "".join(chunk.choices[0].text for chunk in streamed if chunk.choices)
    unary = client.completions.create(model="tiny-llama", prompt=body["prompt"], max_tokens=4, extra_body=split)
    assert text == unary.choices[0].text and text


def test_client_gone_before_a_non_streamed_answer_cancels_its_job(stack: Stack, long_text: str) -> None:
    """vLLM aborts a request whose client left, streamed or not: a `stream=false` job is canceled when its client
    goes away, not run to its end for no one, billed. The client's retry with its Idempotency-Key gets a fresh
    job, not the canceled one's 409."""
    _, key = stack.tenant("unary-gone", allow_placement=True)  # its job list holds this job only
    prompt = HFEngine("tiny-llama").encode(long_text)[:600]
    body = json.dumps({"model": "tiny-llama", "prompt": prompt, "max_tokens": 3000, "prfaas": {"placement": "split"}})
    host, _, port = stack.url.removeprefix("http://").partition(":")
    request = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {key}\r\n"
               f"Content-Type: application/json\r\nIdempotency-Key: gone-1\r\nContent-Length: {len(body)}\r\n\r\n"
               f"{body}")  # fmt: skip
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(request.encode())
        wait_until(lambda: [j["state"] for j in listed(stack, key)] == ["DECODING"], 15, 0.02)
    job_id = str(listed(stack, key)[0]["id"])  # the client has gone, ~4 s before the decode's end

    canceled_s = wait_until(lambda: job(stack, key, job_id)["state"] == "CANCELED", 10, 0.02)
    print(f"canceled {canceled_s:.3f} s after the disconnect")
    assert canceled_s < 1.0
    record = job(stack, key, job_id)
    assert "client disconnected" in str(record.get("error")), record

    headers = {"Authorization": f"Bearer {key}", "Idempotency-Key": "gone-1", "Content-Type": "application/json"}
    retry = httpx.post(f"{stack.url}/v1/completions", content=body, headers=headers, timeout=60)
    assert retry.status_code == 200, retry.text
    answer = retry.json()
    assert answer["id"] != job_id and answer["choices"][0]["finish_reason"] in ("stop", "length"), answer
    assert [j["state"] for j in listed(stack, key)] == ["DONE", "CANCELED"]
    replay = httpx.post(f"{stack.url}/v1/completions", content=body, headers=headers, timeout=30)
    assert replay.json()["id"] == answer["id"]  # the key now names the fresh job


def test_celery_worker_killed_mid_dispatch_another_worker_finishes_the_job(stack: Stack, long_text: str) -> None:
    _, key = stack.tenant("worker-kill", allow_placement=True)  # its job list holds this job only
    prompt = HFEngine("tiny-llama").encode(long_text)[:600]
    call, replies = split_in_background(stack, key, prompt, 45)
    job_id = str(listed(stack, key)[0]["id"])
    first = stack.workers["w1"]
    first.send_signal(signal.SIGKILL)  # the worker is following the slow prefill's events
    first.wait(5)
    stack.start_worker("w2")  # the unacked task comes back to it after dispatch.visibility_s (3 s)
    retried_once_and_answered(stack, key, job_id, call, replies, prompt, 40)


def test_prefill_region_killed_mid_shipment_job_fails_over_and_is_billed_once(stack: Stack, long_text: str) -> None:
    """Last in this module: it kills the stack's only prefill region (attempt 2 runs locally in decode-b)."""
    tenant_id, key = stack.tenant("prefill-kill", allow_placement=True)
    prefill, decode = stack.regions
    prompt = HFEngine("tiny-llama").encode(long_text)[:600]

    def spend() -> float:
        tenants = httpx.get(f"{stack.url}/admin/tenants", headers=ADMIN, timeout=5).json()
        return float(next(t for t in tenants if t["id"] == tenant_id)["spend_usd_this_month"])

    assert spend() == 0.0
    call, replies = split_in_background(stack, key, prompt, 30)
    job_id = str(listed(stack, key)[0]["id"])
    # Mid-shipment: layers go on the wire as they are computed (layer-wise), one per LAYER_DELAY_S
    # here, and tiny-llama has 4. The region's counters only move when a shipment ends, so the
    # timeline's PREFILLING time says when: 2.5 layer delays in, ~2 of 4 layers are shipped.
    timeline = job(stack, key, job_id)["timeline"]
    assert isinstance(timeline, list)
    started = float(next(e["at"] for e in timeline if e["state"] == "PREFILLING"))
    time.sleep(max(0.0, started + 2.5 * LAYER_DELAY_S - time.time()))
    record = job(stack, key, job_id)
    assert record["state"] == "PREFILLING" and record["attempt"] == 1, record  # prefill_done not reached
    prefill.proc.send_signal(signal.SIGKILL)
    prefill.proc.wait(5)

    record = retried_once_and_answered(stack, key, job_id, call, replies, prompt, 20)
    assert record["prefill_region"] != "prefill-a" or record["placement_chosen"] == "local", record
    # billed once (the ledger entry, written after DONE), for the attempt that finished; spend follows the ledger
    ledger = Ledger(stack.ledger_url, migrate=False)
    try:
        wait_until(lambda: ledger.entry(job_id) is not None, 10, 0.05)
        entry = ledger.entry(job_id)
        assert entry is not None and entry.attempts == 2 and entry.total_usd > 0
        wait_until(lambda: spend() == pytest.approx(entry.total_usd, rel=1e-9, abs=1e-12), 10, 0.05)
        time.sleep(0.5)  # a late move of the dead attempt would bill again: none comes
        assert spend() == pytest.approx(entry.total_usd, rel=1e-9, abs=1e-12)
        assert [(w.attempt, w.phase, w.region) for w in ledger.wasted(job_id)] == [(1, "prefill", "prefill-a")]
    finally:
        ledger.close()
    assert metric(decode.metrics, "prfaas_decode_reservations") == 0
