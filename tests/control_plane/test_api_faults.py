"""Faults around a running job, on real processes (bench/cp_stack.py): the API, a Celery
worker, a prefill and a decode region (tiny-llama), real Redis, the official openai client.
A stack of its own, so the regions' gauges (KV bytes held, leases) start at zero."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from cp_kit import ensure_redis

from prfaas.bench.cp_stack import Stack, wait_until
from prfaas.engine.hf import HFEngine
from prfaas.engine.models import prepare_model

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    ensure_redis()
    prepare_model("tiny-llama")
    s = Stack(tmp_path_factory.mktemp("cp-faults"))
    try:
        s.start_api()
        s.start_worker("w1")
        s.region("prefill-a", "prefill", 0.5)
        s.region("decode-b", "decode", 4.0)
        s.put_link("prefill-a", "decode-b")
        wait_until(lambda: len(s.healthy()) == 2, 20, 0.1)
        yield s
    finally:
        s.stop()
        s.cleanup()


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


def test_client_disconnect_mid_stream_cancels_the_job_in_both_regions(stack: Stack, key: str, long_text: str) -> None:
    prefill, decode = stack.regions
    prompt = HFEngine("tiny-llama").encode(long_text)[:600]
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key=key, max_retries=0, timeout=30)
    # 1500 tokens take tiny-llama ~15 s on this host: the stream is cut well before its end
    stream = client.completions.create(
        model="tiny-llama", prompt=prompt, max_tokens=1500, stream=True, extra_body={"prfaas": {"placement": "split"}}
    )
    chunks = [next(stream) for _ in range(5)]
    job_id = chunks[0].id
    assert job(stack, key, job_id)["state"] == "DECODING"
    assert metric(decode.metrics, "prfaas_decode_kv_used_bytes") > 0  # the reservation holds the prompt's KV
    assert metric(prefill.metrics, "prfaas_prefill_kv_leases") == 1  # kept 30 s for a re-shipment
    canceled_before = metric(decode.metrics, "prfaas_decode_reservations_ended_total", outcome="cancelled")

    stream.close()  # the client goes away mid-stream

    wait_until(lambda: job(stack, key, job_id)["state"] == "CANCELED", 10, 0.05)
    wait_until(lambda: metric(decode.metrics, "prfaas_decode_kv_used_bytes") == 0, 5, 0.05)
    assert metric(decode.metrics, "prfaas_decode_reservations") == 0
    assert metric(prefill.metrics, "prfaas_prefill_kv_leases") == 0  # released by Cancel, not by the 30 s lease
    assert metric(decode.metrics, "prfaas_decode_reservations_ended_total", outcome="cancelled") == canceled_before + 1
    record = job(stack, key, job_id)
    timeline = record["timeline"]
    assert isinstance(timeline, list) and timeline[-1]["state"] == "CANCELED", timeline
    assert "client disconnected" in str(record.get("error")), record
    tokens = metric(decode.metrics, "prfaas_decode_tokens_total")
    time.sleep(0.5)
    assert metric(decode.metrics, "prfaas_decode_tokens_total") == tokens  # decoding stopped
