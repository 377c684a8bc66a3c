"""A job's spans, as the API process and the dispatcher export them (the app in-process on the real Redis, the
dispatcher in-process, the regions test servicers on real gRPC servers: fake_regions.py): every span of a job's
trace carries its `prfaas.job_id` (what `prfaas trace JOB_ID` finds them by), the job's `api.job` span is
exported on every path (a batch whose later prompt is refused, a streaming client gone before its first chunk),
and a span that ends on an error nobody expected is exported failed, not "ok"."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import anyio
import pytest
import redis
from cp_kit import ADMIN_KEY, cleanup, ensure_redis, make_settings
from fake_regions import FakeRegions
from fastapi.testclient import TestClient
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from prfaas.control_plane.api import completions
from prfaas.control_plane.app import create_app
from prfaas.control_plane.jobs.dispatch import Dispatcher
from prfaas.control_plane.jobs.generation import Follower
from prfaas.control_plane.tenants import Quota
from prfaas.protos.prfaas.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from prfaas.telemetry import tracing

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
TOKENS = [11, 12, 13]
PROMPT = list(range(1, 65))


class Prefill(prefill_pb2_grpc.PrefillRegionServicer):
    async def Prefill(self, request: Any, context: Any) -> Any:  # noqa: N802
        yield prefill_pb2.PrefillEvent(started=prefill_pb2.Started())
        kv = common_pb2.KVDescriptor(num_tokens=len(request.token_ids), dtype="float32")
        done = prefill_pb2.PrefillDone(first_token=TOKENS[0], kv=kv, prefill_s=0.01)
        yield prefill_pb2.PrefillEvent(prefill_done=done)
        yield prefill_pb2.PrefillEvent(shipment_complete=prefill_pb2.ShipmentComplete(raw_bytes=8, wire_bytes=4))

    async def Cancel(self, request: Any, context: Any) -> Any:  # noqa: N802
        return common_pb2.CancelReply()


class Decode(decode_pb2_grpc.DecodeRegionServicer):
    async def Reserve(self, request: Any, context: Any) -> Any:  # noqa: N802
        return decode_pb2.ReserveReply(kv_endpoint="127.0.0.1:9", free_bytes=1 << 40, expires_in_s=request.ttl_s)

    async def Release(self, request: Any, context: Any) -> Any:  # noqa: N802
        return decode_pb2.ReleaseReply(found=True)

    async def Decode(self, request: Any, context: Any) -> Any:  # noqa: N802
        for event in _tokens():
            yield event

    async def Generate(self, request: Any, context: Any) -> Any:  # noqa: N802
        for event in _tokens():
            yield event

    async def Cancel(self, request: Any, context: Any) -> Any:  # noqa: N802
        return common_pb2.CancelReply()


def _tokens() -> Iterator[decode_pb2.TokenEvent]:
    for i, token in enumerate(TOKENS):
        yield decode_pb2.TokenEvent(index=i, token=token, last=i == len(TOKENS) - 1, finish_reason="length")


@pytest.fixture
def spans(monkeypatch: pytest.MonkeyPatch) -> InMemorySpanExporter:
    """Every span the code under test starts (it reads `tracing.tracer` at each start), kept in memory."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(tracing, "tracer", provider.get_tracer("test"))
    return exporter


@pytest.fixture
def client(monkeypatch: pytest.MonkeyPatch) -> Iterator[TestClient]:
    """The API in-process; a job queued for dispatch is dispatched at once, in-process (no Celery worker)."""
    ensure_redis()
    settings = make_settings()
    with TestClient(create_app(settings)) as c:
        services = c.app.state.services  # type: ignore[attr-defined]
        dispatcher = Dispatcher(services, lambda job_id, countdown_s: None, owner=f"worker:{uuid.uuid4().hex[:6]}")
        monkeypatch.setattr(completions, "enqueue", lambda _celery, job_id: dispatcher.run(job_id))
        c.app.state.dispatcher = dispatcher  # type: ignore[attr-defined]
        yield c
    cleanup(settings)


def _key(client: TestClient, **fields: object) -> dict[str, str]:
    tenant = client.post("/admin/tenants", json={"name": "acme", "allow_placement": True} | fields, headers=ADMIN)
    key = client.post(f"/admin/tenants/{tenant.json()['id']}/keys", headers=ADMIN)
    return {"Authorization": f"Bearer {key.json()['key']}"}


def _of_job(spans: list[ReadableSpan], job_id: str) -> list[ReadableSpan]:
    """The spans of the trace(s) that `job_id`'s spans are in (as `prfaas trace` gathers them)."""
    traces = {s.context.trace_id for s in spans if s.context and (s.attributes or {}).get(tracing.JOB_ID) == job_id}
    return [s for s in spans if s.context and s.context.trace_id in traces]


def test_every_span_of_a_job_carries_its_job_id(client: TestClient, spans: InMemorySpanExporter) -> None:
    services = client.app.state.services  # type: ignore[attr-defined]
    regions = FakeRegions(services.regions, Prefill(), Decode())
    try:
        key = _key(client)
        job_ids = {}
        for placement in ("split", "local"):  # split: dispatched by the worker; local: placed by the API itself
            body = {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": 3, "prfaas": {"placement": placement}}
            reply = client.post("/v1/completions", json=body, headers=key)
            assert reply.status_code == 200, reply.text
            job_ids[placement] = reply.json()["id"]
        watcher = client.app.state.dispatcher.watcher  # type: ignore[attr-defined]
        deadline = time.monotonic() + 10
        while watcher.in_flight and time.monotonic() < deadline:  # the prefill's span ends with its stream
            time.sleep(0.02)
    finally:
        regions.close()
    finished = list(spans.get_finished_spans())
    expected = {
        "split": {"api.job", "api.admission", "api.placement", "api.decode", "worker.dispatch", "worker.placement",
                  "worker.reserve", "worker.prefill"},
        "local": {"api.job", "api.admission", "api.placement", "api.decode"},
    }  # fmt: skip
    for placement, job_id in job_ids.items():
        of_job = _of_job(finished, job_id)
        assert {s.name for s in of_job} == expected[placement]
        without = sorted(s.name for s in of_job if (s.attributes or {}).get(tracing.JOB_ID) != job_id)
        assert without == [], f"{placement}: spans without prfaas.job_id {job_id}"


def test_the_job_span_is_exported_when_a_later_prompt_of_the_batch_is_refused(
    client: TestClient, spans: InMemorySpanExporter
) -> None:
    key = _key(client, concurrency=2)
    services = client.app.state.services  # type: ignore[attr-defined]
    (tenant,) = [t for t in services.tenants.all() if t.name == "acme"]
    # another request of the tenant's mid-admission holds a slot: the second prompt's job is one too many (a batch
    # the limits never admit whole is refused before any prompt, 400 batch_too_large)
    held = services.settings.key("tenant", tenant.id, "admitting")
    services.redis.zadd(held, {"another-request": time.time() + 60})
    body = {"model": "tiny-llama", "prompt": [PROMPT, PROMPT], "max_tokens": 3}
    reply = client.post("/v1/completions", json=body, headers=key)
    assert (reply.status_code, reply.json()["error"]["code"]) == (429, "concurrency_limit_exceeded")
    jobs = [s for s in spans.get_finished_spans() if s.name == "api.job"]
    assert len(jobs) == 2  # the first prompt's too, though its stream was never read
    assert all(s.status.status_code is StatusCode.ERROR for s in jobs)
    descriptions = sorted(str(s.status.description) for s in jobs)
    assert "another prompt of the request was refused" in descriptions


def test_the_job_spans_are_exported_when_a_streaming_client_leaves_before_its_first_chunk(
    client: TestClient, spans: InMemorySpanExporter
) -> None:
    key = _key(client)
    for prompts in (PROMPT, [PROMPT, PROMPT]):  # one job (Follower.disconnected), a batch of two
        spans.clear()
        body = f'{{"model": "tiny-llama", "prompt": {prompts}, "max_tokens": 3, "stream": true}}'.encode()
        _gone_before_the_first_chunk(client, body, key)
        jobs = [s for s in spans.get_finished_spans() if s.name == "api.job"]
        assert len(jobs) == (1 if prompts is PROMPT else 2), prompts
        assert all((s.attributes or {}).get("prfaas.closed_early") for s in jobs)


def _gone_before_the_first_chunk(client: TestClient, body: bytes, key: dict[str, str]) -> None:
    """POST /v1/completions as a client that disconnects once the response starts, before its first chunk."""
    headers = [(b"content-type", b"application/json"), (b"authorization", key["Authorization"].encode())]
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
             "query_string": b"", "root_path": "", "headers": headers, "client": ("127.0.0.1", 1),
             "server": ("testserver", 80), "state": {}}  # fmt: skip
    messages = [{"type": "http.request", "body": body, "more_body": False}]
    statuses: list[int] = []

    async def receive() -> dict[str, Any]:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            statuses.append(message["status"])
            await anyio.sleep(0.3)  # the disconnect is seen before the first chunk is asked for

    client.portal.call(client.app, scope, receive, send)  # type: ignore[union-attr, arg-type]
    assert statuses == [200]


def test_an_unexpected_error_fails_the_dispatch_span_and_is_raised(
    client: TestClient, spans: InMemorySpanExporter, monkeypatch: pytest.MonkeyPatch
) -> None:
    dispatcher = client.app.state.dispatcher  # type: ignore[attr-defined]
    services = client.app.state.services  # type: ignore[attr-defined]
    fields = {"model": "tiny-llama", "kind": "text_completion", "token_ids": PROMPT, "prompt_tokens": 64,
              "max_new_tokens": 3, "temperature": 0.0, "placement_asked": "split"}  # fmt: skip
    job_id = services.jobs.create(
        "t-" + uuid.uuid4().hex[:8], fields, Quota(rps=100, concurrency=10, budget_usd=100)
    ).job_id

    def away(*_args: object) -> None:
        raise redis.ConnectionError("Redis went away mid-placement")

    monkeypatch.setattr(dispatcher, "decide", away)
    with pytest.raises(redis.ConnectionError):
        dispatcher.run(job_id)
    (span,) = [s for s in spans.get_finished_spans() if s.name == "worker.dispatch"]
    assert span.status.status_code is StatusCode.ERROR
    assert span.status.description == "Redis went away mid-placement"


def test_a_decode_call_that_fails_unexpectedly_is_exported_failed(
    client: TestClient, spans: InMemorySpanExporter, monkeypatch: pytest.MonkeyPatch
) -> None:
    services = client.app.state.services  # type: ignore[attr-defined]
    regions = FakeRegions(services.regions, Prefill(), Decode())
    try:
        key = _key(client)
        follower: Follower = client.app.state.follower  # type: ignore[attr-defined]

        def away(*_args: object, **_kwargs: object) -> None:
            raise redis.ConnectionError("Redis went away mid-stream")

        monkeypatch.setattr(follower.log, "log_token", away)  # the first token logged
        body = {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": 3, "prfaas": {"placement": "local"}}
        reply = client.post("/v1/completions", json=body, headers=key)
        assert reply.status_code == 503, reply.text
    finally:
        regions.close()
    (call,) = [s for s in spans.get_finished_spans() if s.name == "api.decode"]
    assert call.status.status_code is StatusCode.ERROR
    assert call.status.description == "Redis went away mid-stream"


def test_a_prefill_followed_past_its_hand_off_that_fails_is_exported_failed(
    client: TestClient, spans: InMemorySpanExporter, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Redis away when the shipment's byte counts are recorded: the job decodes all the same (it is not taken
    back for a lost byte count), but its prefill's span says the following failed."""
    services = client.app.state.services  # type: ignore[attr-defined]
    update = services.jobs.update

    def away_for_byte_counts(job_id: str, attempt: int, **fields: Any) -> bool:
        if "bytes_wire" in fields:  # only the shipment_complete event records it
            raise redis.ConnectionError("Redis went away after the hand-off")
        return bool(update(job_id, attempt, **fields))

    monkeypatch.setattr(services.jobs, "update", away_for_byte_counts)
    regions = FakeRegions(services.regions, Prefill(), Decode())
    try:
        body = {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": 3, "prfaas": {"placement": "split"}}
        reply = client.post("/v1/completions", json=body, headers=_key(client))
        assert reply.status_code == 200, reply.text  # the job decodes all the same
        watcher = client.app.state.dispatcher.watcher  # type: ignore[attr-defined]
        deadline = time.monotonic() + 10
        while watcher.in_flight and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        regions.close()
    (prefill_span,) = [s for s in spans.get_finished_spans() if s.name == "worker.prefill"]
    assert prefill_span.status.status_code is StatusCode.ERROR
    assert prefill_span.status.description == "Redis went away after the hand-off"
