"""A decode region configured `transport: webrtc` serves split requests end to end through
the control plane: real API and Celery worker processes, a prefill and a decode region
(`prfaas region`, tiny-llama), the KV over a WebRTC data channel whose offer and answer
travel through the control plane's registry (Signal / Offers / Answer).

Everything runs in a network namespace the test creates, whose loopback also has 127.0.0.2
(aiortc gathers no 127.0.0.1 host candidate), with a Redis of its own in there."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import redis
from netns_kit import can_create, netns

from prfaas.devstack.stack import Stack, wait_until
from prfaas.engine.hf import HFEngine
from prfaas.engine.models import prepare_model
from prfaas.engine.sampling import SamplingParams
from prfaas.engine.stops import output_text

pytestmark = pytest.mark.e2e
REDIS_PORT = 6391


@contextlib.contextmanager
def _redis(folder: Path) -> Iterator[None]:
    """A Redis of this namespace's own on REDIS_PORT, answering pings, until the block ends."""
    server = subprocess.Popen(
        ["redis-server", "--port", str(REDIS_PORT), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(folder)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        client = redis.Redis(port=REDIS_PORT, socket_timeout=1)
        wait_until(lambda: _pings(client), 10, 0.05)
        yield
    finally:
        server.kill()
        server.wait(5)


@pytest.fixture(scope="module")
def rtc_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    if not can_create():
        pytest.skip("needs root to create a network namespace")
    prepare_model("tiny-llama")
    folder = tmp_path_factory.mktemp("webrtc-e2e")
    with netns(f"prfaas-rtc-e2e-{os.getpid()}"), _redis(folder):  # every process started below inherits it
        stack = Stack(folder, PRFAAS_REDIS_URL=f"redis://127.0.0.1:{REDIS_PORT}/0")
        try:
            stack.start_api()
            stack.start_worker("w1")
            with ThreadPoolExecutor(2) as pool:  # both regions load their model at once
                prefill = pool.submit(stack.region, "prefill-a", "prefill", 0.5)
                decode = pool.submit(stack.region, "decode-rtc", "decode", 4.0, transport="webrtc").result()
                prefill.result()
            assert decode.kv == "webrtc://decode-rtc", decode.kv
            stack.put_link("prefill-a", "decode-rtc")
            wait_until(lambda: len(stack.healthy()) == 2, 30, 0.1)
            yield stack
        finally:
            stack.stop()


def _pings(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False


def test_split_request_through_a_webrtc_region_equals_colocated(rtc_stack: Stack, long_text: str) -> None:
    engine = HFEngine("tiny-llama")
    _, key = rtc_stack.tenant("acme", allow_placement=True)
    client = openai.OpenAI(base_url=rtc_stack.url + "/v1", api_key=key, max_retries=0, timeout=90)
    ids = engine.encode(long_text)
    for prompt in (ids[:600], ids[600:1200]):  # the second reuses the pooled data channel (a prompt no region holds)
        reply = client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=8)
        colocated = engine.generate(prompt, SamplingParams(max_new_tokens=8))
        assert reply.choices[0].text == output_text(engine.decode_text, colocated)
        job = httpx.get(f"{rtc_stack.url}/v1/jobs/{reply.id}", headers={"Authorization": f"Bearer {key}"}).json()
        assert job["placement_chosen"] == "split", job
        assert job["decode_region"] == "decode-rtc" and job["prefill_region"] == "prefill-a"
        assert [e["state"] for e in job["timeline"]] == ["QUEUED", "PREFILLING", "TRANSFERRING", "DECODING", "DONE"]
        assert job["bytes_raw"] == len(prompt) * engine.kv_bytes_per_token


_SIGNAL_PROBE = """
import sys, grpc
from prfaas.protos.prfaas.v1 import registry_pb2, registry_pb2_grpc
stub = registry_pb2_grpc.RegistryStub(grpc.insecure_channel(sys.argv[1]))
for request in (registry_pb2.SignalRequest(region="nowhere", offer_sdp="v=0", timeout_s=1.0),
                registry_pb2.SignalRequest(region="", offer_sdp="")):
    try:
        stub.Signal(request, timeout=5)
        print("OK")
    except grpc.RpcError as exc:
        print(exc.code().name, exc.details())
"""


def test_signalling_for_an_unknown_region_times_out_with_a_clear_status(rtc_stack: Stack) -> None:
    # From a child process started on this thread, so inside the namespace: gRPC connects from
    # threads of its own, and those the test process started earlier live in the root namespace.
    probe = subprocess.run(
        [sys.executable, "-c", _SIGNAL_PROBE, rtc_stack.registry], capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert probe.returncode == 0, probe.stderr
    unknown, empty = probe.stdout.splitlines()
    assert unknown.startswith("DEADLINE_EXCEEDED") and "did not answer" in unknown, unknown
    assert empty.startswith("INVALID_ARGUMENT"), empty
