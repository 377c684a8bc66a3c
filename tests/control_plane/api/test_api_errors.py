"""Every 4xx and 5xx of the /v1 API has OpenAI's error object, as the official `openai` client sees it
(its typed exception, `.type`, `.code`, `.param`), on a real API process (uvicorn) with no worker and no
region: an admitted job stays QUEUED until the test moves it or the API's 3 s deadline passes. Also the
body cap (413, with and without Content-Length), an Idempotency-Key reused with another body (422), and
a stream that fails after it started (the same object as an SSE line)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import pytest
from cp_kit import api_stack, openai_client, stack_services

from prfaas.control_plane.jobs.states import JobState
from prfaas.control_plane.services import Services
from prfaas.devstack.stack import ADMIN, Stack, wait_until

pytestmark = pytest.mark.e2e
MAX_BODY_BYTES = 1 << 20  # 1 MiB here (default 8 MiB), so the oversize bodies stay small


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    env = {"PRFAAS_JOB_TIMEOUT_S": "3", "PRFAAS_MAX_BODY_BYTES": str(MAX_BODY_BYTES)}
    yield from api_stack(tmp_path_factory.mktemp("cp-errors"), **env)


@pytest.fixture(scope="module")
def services(stack: Stack) -> Iterator[Services]:
    yield from stack_services(stack)


def client(stack: Stack, key: str) -> openai.OpenAI:
    return openai_client(stack, key, 30)


def refused(call: Callable[[], object], kind: type[openai.APIStatusError]) -> openai.APIStatusError:
    with pytest.raises(kind) as info:
        call()
    assert set(info.value.body) == {"message", "type", "param", "code"}, info.value.body  # type: ignore[arg-type]
    return info.value


def fields(e: openai.APIStatusError) -> tuple[int, str | None, str | None, str | None, str]:
    return e.status_code, e.type, e.code, e.param, e.body["message"]  # type: ignore[index]


def test_client_errors_have_openai_shape(stack: Stack) -> None:
    _, key = stack.tenant("shapes", allow_placement=False)
    c = client(stack, key)
    m = "tiny-llama"
    cases: list[tuple[Callable[[], object], type[openai.APIStatusError], tuple[Any, ...]]] = [
        (lambda: c.completions.create(model=m, prompt="hi", max_tokens=0), openai.BadRequestError,
         (400, "invalid_request_error", "invalid_request", "max_tokens",
          "invalid request: max_tokens: Input should be greater than or equal to 1 (0 with echo only)")),
        (lambda: c.chat.completions.create(model=m, messages=[{"role": "robot", "content": "hi"}]),  # type: ignore[misc, list-item]
         openai.BadRequestError, (400, "invalid_request_error", "invalid_request", "messages.0.role", None)),
        (lambda: c.completions.create(model=m, prompt="hi " * 5000), openai.BadRequestError,
         (400, "invalid_request_error", "context_length_exceeded", "prompt",
          "prompt too long for the model: 10000 tokens, and its context is 4096 (a prompt must leave room for one "
          "token)")),
        (lambda: client(stack, "pfk-unknown").models.list(), openai.AuthenticationError,
         (401, "authentication_error", "invalid_api_key", None, "invalid API key")),
        (lambda: c.completions.create(model=m, prompt="hi", extra_body={"prfaas": {"placement": "split"}}),
         openai.PermissionDeniedError, (403, "permission_error", "placement_not_allowed", "prfaas.placement",
                                        "placement requests are not enabled for this tenant")),
        (lambda: c.completions.create(model="gpt-9", prompt="hi"), openai.NotFoundError,
         (404, "not_found_error", "model_not_found", "model",
                                       "model not found: 'gpt-9'; this deployment serves 'tiny-llama'")),
        (lambda: c.get("/jobs/00000000-0000-4000-8000-000000000000", cast_to=object), openai.NotFoundError,
         (404, "not_found_error", "job_not_found", None, "job not found")),
        (lambda: c.get("/nowhere", cast_to=object), openai.NotFoundError,
         (404, "invalid_request_error", "unknown_url", None, "unknown URL: GET /v1/nowhere")),
        (lambda: c.completions.create(model=m, prompt="hi", stream_options={"include_usage": True}),
         openai.BadRequestError, (400, "invalid_request_error", "invalid_request", "stream_options",
                                  "invalid request: stream_options: Stream options can only be defined when "
                                  "`stream=True`.")),
    ]  # fmt: skip
    for call, kind, expected in cases:
        got = fields(refused(call, kind))
        assert got[:4] == expected[:4] and (expected[4] is None or got[4] == expected[4]), (got, expected)


def test_suspended_budget_rate_and_concurrency_refusals(stack: Stack) -> None:
    tenant_id, key = stack.tenant("suspended")
    httpx.post(f"{stack.url}/admin/tenants/{tenant_id}/suspend", headers=ADMIN, timeout=5).raise_for_status()
    e = refused(lambda: client(stack, key).models.list(), openai.PermissionDeniedError)
    assert fields(e) == (403, "permission_error", "tenant_suspended", None, "tenant suspended")

    _, broke = stack.tenant("broke", budget_usd=0)
    e = refused(lambda: client(stack, broke).completions.create(model="tiny-llama", prompt="hi"), openai.APIStatusError)
    assert fields(e) == (402, "insufficient_quota", "budget_exhausted", None, "monthly budget exhausted")

    tenant_id, busy = stack.tenant("busy", concurrency=1)
    held = client(stack, busy).completions.create(model="tiny-llama", prompt="hi", stream=True)  # QUEUED: holds it
    e = refused(lambda: client(stack, busy).completions.create(model="tiny-llama", prompt="hi"), openai.RateLimitError)
    assert fields(e) == (429, "rate_limit_error", "concurrency_limit_exceeded", None, "too many concurrent jobs")
    assert e.response.headers["retry-after"] == "1"
    held.close()

    _, fast = stack.tenant("fast", rps=1)
    streams, limited = [], []
    for _ in range(4):  # 4 requests within at most two 1 s windows of 1: at least 2 refused
        try:
            streams.append(client(stack, fast).completions.create(model="tiny-llama", prompt="hi", stream=True))
        except openai.RateLimitError as exc:
            limited.append(fields(exc))
    assert len(limited) >= 2 and set(limited) == {
        (429, "rate_limit_error", "rate_limit_exceeded", None, "rate limit exceeded")
    }
    for s in streams:
        s.close()


def test_oversize_body_is_413_with_or_without_content_length(stack: Stack) -> None:
    _, key = stack.tenant("big")
    too_big = [5] * (MAX_BODY_BYTES // 2)  # "5, " x 512 Ki: 1.5 MiB of JSON
    e = refused(
        lambda: client(stack, key).completions.create(model="tiny-llama", prompt=too_big), openai.APIStatusError
    )
    assert fields(e) == (
        413, "invalid_request_error", "request_too_large", None,
        f"request body too large: more than {MAX_BODY_BYTES} bytes",
    )  # fmt: skip

    def chunked() -> Iterator[bytes]:  # no Content-Length: counted while read, refused mid-body
        yield b'{"model": "tiny-llama", "prompt": [5'
        for _ in range(64):
            yield b", 5" * 10_000
        yield b"]}"

    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    reply = httpx.post(f"{stack.url}/v1/completions", content=chunked(), headers=headers, timeout=30)
    assert reply.status_code == 413 and reply.json()["error"]["code"] == "request_too_large", reply.text
    admin = httpx.post(f"{stack.url}/admin/tenants", content=b"{" + b" " * MAX_BODY_BYTES + b"}", headers=ADMIN)
    assert admin.status_code == 413 and admin.json() == {
        "detail": f"request body too large: more than {MAX_BODY_BYTES} bytes"
    }


def test_idempotency_key_reused_with_another_body_is_422(stack: Stack) -> None:
    _, key = stack.tenant("idem")
    c = client(stack, key)
    headers = {"Idempotency-Key": "order-17"}
    first = c.completions.create(model="tiny-llama", prompt="once", max_tokens=4, stream=True, extra_headers=headers)
    job_id = first.response.headers["x-prfaas-job-id"]
    again = c.completions.create(model="tiny-llama", prompt="once", max_tokens=4, stream=True, extra_headers=headers)
    assert again.response.headers["x-prfaas-job-id"] == job_id  # the same body: the same job
    e = refused(
        lambda: c.completions.create(model="tiny-llama", prompt="twice", max_tokens=4, extra_headers=headers),
        openai.UnprocessableEntityError,
    )
    assert fields(e) == (
        422, "invalid_request_error", "idempotency_key_reused", None,
        "Idempotency-Key already used with a different request body",
    )  # fmt: skip
    for s in (first, again):
        s.close()


def test_a_clients_own_key_never_names_a_prompt_of_another_requests_batch(stack: Stack) -> None:
    """A batch stores its later prompts under keys of their own: the client key "bat:1", with the same body,
    is a new request, not prompt 1 of the batch sent with "bat" (whose output it would have answered)."""
    _, key = stack.tenant("idem-batch")
    c = client(stack, key)
    streams = []
    for idem in ("bat", "bat:1"):
        streams.append(c.completions.create(model="tiny-llama", prompt=["a", "b"], max_tokens=2, stream=True,
                                            extra_headers={"Idempotency-Key": idem}))  # fmt: skip
    listed = httpx.get(f"{stack.url}/v1/jobs", headers={"Authorization": f"Bearer {key}"}, timeout=5).json()["data"]
    assert len(listed) == 4  # two prompts each, none shared
    assert streams[0].response.headers["x-prfaas-job-id"] != streams[1].response.headers["x-prfaas-job-id"]
    for s in streams:
        s.close()


def test_metadata_is_held_to_openais_limits_and_refuses_lone_surrogates(stack: Stack) -> None:
    """A lone surrogate in metadata failed the Idempotency-Key's body hash with a 500; now metadata strings are
    checked as every other string (and to OpenAI's 16 pairs, keys of 64 and values of 512 characters)."""
    _, key = stack.tenant("meta")
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json", "Idempotency-Key": "meta-1"}
    body = (
        b'{"model":"tiny-llama","messages":[{"role":"user","content":"x"}],"max_tokens":2,"metadata":{"k":"\\ud800"}}'
    )
    reply = httpx.post(f"{stack.url}/v1/chat/completions", content=body, headers=headers, timeout=10)
    assert reply.status_code == 400 and reply.json()["error"]["code"] == "invalid_request", reply.text
    many = {"model": "tiny-llama", "prompt": "x", "max_tokens": 2, "metadata": {str(i): "v" for i in range(17)}}
    reply = httpx.post(f"{stack.url}/v1/completions", json=many, headers=headers, timeout=10)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "metadata", reply.text


def _waiting(stack: Stack, key: str, stream: bool = False) -> tuple[threading.Thread, list[object], str]:
    """A completion asked on a thread of its own; returns once its job is QUEUED (the tenant's only job)."""
    outcome: list[object] = []

    def call() -> None:
        try:
            reply = client(stack, key).completions.create(model="tiny-llama", prompt="wait", stream=stream)
            outcome.append(list(reply) if stream else reply)  # type: ignore[call-overload]
        except openai.APIError as exc:
            outcome.append(exc)

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    jobs: list[dict[str, Any]] = []

    def queued() -> bool:
        jobs[:] = httpx.get(f"{stack.url}/v1/jobs", headers={"Authorization": f"Bearer {key}"}, timeout=5).json()[
            "data"
        ]
        return bool(jobs) and jobs[0]["state"] == "QUEUED"

    wait_until(queued, 10, 0.02)
    return thread, outcome, str(jobs[0]["id"])


def test_job_endings_have_openai_shape(stack: Stack, services: Services) -> None:
    _, key = stack.tenant("endings")
    thread, outcome, job_id = _waiting(stack, key)
    httpx.delete(f"{stack.url}/v1/jobs/{job_id}", headers={"Authorization": f"Bearer {key}"}, timeout=5)
    thread.join(10)
    e = outcome[0]
    assert isinstance(e, openai.ConflictError)
    assert fields(e) == (409, "conflict_error", "job_canceled", None, "job canceled: canceled by the tenant")

    thread, outcome, job_id = _waiting(stack, key)
    services.jobs.transition(job_id, JobState.FAILED, 1, note="no region", error="no placement: no region")
    thread.join(10)
    e = outcome[0]
    assert isinstance(e, openai.InternalServerError)
    assert fields(e) == (503, "server_error", "job_failed", None, "job failed: no placement: no region")

    e = refused(
        lambda: client(stack, key).completions.create(model="tiny-llama", prompt="slow"), openai.InternalServerError
    )
    assert fields(e) == (504, "server_error", "job_timeout", None, "job timeout: no result within 3 s")

    thread, outcome, job_id = _waiting(stack, key, stream=True)  # the stream started: the error is an SSE line
    services.jobs.transition(job_id, JobState.FAILED, 1, note="no region", error="no placement: no region")
    thread.join(10)
    e = outcome[0]
    assert type(e) is openai.APIError, e
    assert e.body == {"message": "job failed: no placement: no region", "type": "server_error", "param": None,
                      "code": "job_failed"}  # fmt: skip


def _listed(stack: Stack, key: str) -> list[dict[str, Any]]:
    """The tenant's jobs, oldest first."""
    reply = httpx.get(f"{stack.url}/v1/jobs", headers={"Authorization": f"Bearer {key}"}, timeout=5)
    return sorted(reply.json()["data"], key=lambda job: job["created_at"])


def test_a_stream_whose_client_leaves_before_its_first_token_cancels_its_job(stack: Stack) -> None:
    """The client gives up while its job still waits for a prefill (QUEUED here): the job is canceled then,
    not when its first token comes (before, the prefill, the KV shipment and the decode ran for no one)."""
    _, key = stack.tenant("leaves-early")
    body = {"model": "tiny-llama", "prompt": "wait", "stream": True}
    with httpx.stream("POST", f"{stack.url}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"},
                      timeout=10) as response:  # fmt: skip
        assert response.status_code == 200
        job_id = response.headers["x-prfaas-job-id"]
        wait_until(lambda: [j["state"] for j in _listed(stack, key)] == ["QUEUED"], 5, 0.02)
    left = time.monotonic()
    wait_until(lambda: _listed(stack, key)[0]["state"] != "QUEUED", 5, 0.02)
    assert _listed(stack, key)[0]["state"] == "CANCELED" and time.monotonic() - left < 2.0  # the deadline: 3 s
    assert _listed(stack, key)[0]["id"] == job_id


def test_a_batch_answers_the_error_of_its_prompt_that_failed(stack: Stack, services: Services) -> None:
    """Prompt 1's job fails: the answer is its 503, not the 409 of prompt 0's job, which the failure canceled."""
    _, key = stack.tenant("batch-fails", concurrency=2)
    outcome: list[object] = []

    def call() -> None:
        try:
            outcome.append(client(stack, key).completions.create(model="tiny-llama", prompt=["one", "two"]))
        except openai.APIError as exc:
            outcome.append(exc)

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    wait_until(lambda: [j["state"] for j in _listed(stack, key)] == ["QUEUED", "QUEUED"], 5, 0.02)
    second = str(_listed(stack, key)[1]["id"])
    services.jobs.transition(second, JobState.FAILED, 1, note="no region", error="no placement: no region")
    thread.join(10)
    e = outcome[0]
    assert isinstance(e, openai.InternalServerError), e
    assert fields(e) == (503, "server_error", "job_failed", None, "job failed: no placement: no region")


def test_a_stream_that_fails_ends_with_its_error_then_done(stack: Stack, services: Services) -> None:
    """As vLLM ends every stream: the error event, then `data: [DONE]`."""
    _, key = stack.tenant("fails-streamed")
    body = {"model": "tiny-llama", "prompt": "wait", "stream": True}
    lines: list[str] = []
    with httpx.stream("POST", f"{stack.url}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"},
                      timeout=10) as response:  # fmt: skip
        wait_until(lambda: [j["state"] for j in _listed(stack, key)] == ["QUEUED"], 5, 0.02)
        job_id = response.headers["x-prfaas-job-id"]
        services.jobs.transition(job_id, JobState.FAILED, 1, note="no region", error="no placement: no region")
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and '"code": "job_failed"' in lines[-2], lines
