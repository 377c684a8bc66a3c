"""An API process told to stop (SIGTERM, as `prfaas down`, Kubernetes or systemd send it) drains, as vLLM's
`--shutdown-timeout` (api/shutdown.py), on real processes: uvicorn, a Celery worker, a prefill and a decode region
of tiny-llama whose decode emits a token every TOKEN_DELAY_S.

A stream in flight at the signal goes on to its end within `shutdown_timeout_s`; one that would take longer ends
with a `server_shutting_down` error event (then `[DONE]`, as vLLM ends a failed stream) when the time is up, as
does a `stream=false` request (a 503 answer), never with a cut connection; its job is canceled, and its
Idempotency-Key gets a fresh job at the next API process. A request whose body was still coming in at the signal
is refused with that 503. Before, the API waited for its streams with no deadline until `prfaas down` killed it,
and its clients saw the connection drop."""

from __future__ import annotations

import json
import signal
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from cp_kit import stack_services, two_region_stack

from prfaas.devstack.stack import ADMIN, Stack, wait_until

pytestmark = pytest.mark.e2e
TOKEN_DELAY_S = 0.1


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    yield from two_region_stack(tmp_path_factory.mktemp("drain"), decode_fields={"test_token_delay_s": TOKEN_DELAY_S})


def _restart_api(stack: Stack, shutdown_timeout_s: float) -> None:
    """A fresh API process (the last one drained and exited) whose drain lasts `shutdown_timeout_s`."""
    if stack.api is not None and stack.api.poll() is None:
        stack.api.send_signal(signal.SIGTERM)
        stack.api.wait(30)
    stack.env["PRFAAS_SHUTDOWN_TIMEOUT_S"] = str(shutdown_timeout_s)
    stack.start_api()
    wait_until(lambda: len(stack.healthy()) == 2, 30, 0.2)  # the regions registered with it again


def _body(max_tokens: int, stream: bool) -> dict[str, Any]:
    return {"model": "tiny-llama", "prompt": [5, 6, 7, 8, 9], "max_tokens": max_tokens, "ignore_eos": True,
            "stream": stream, "prfaas": {"placement": "local"}}  # fmt: skip


def _events(reply: httpx.Response, on_first: Any) -> list[dict[str, Any] | str]:
    """The stream's events (`[DONE]` as a string); `on_first()` runs at its first token."""
    events: list[dict[str, Any] | str] = []
    first = True
    for line in reply.iter_lines():
        if not line.startswith("data: "):
            continue
        event = line[6:] if line == "data: [DONE]" else json.loads(line[6:])
        events.append(event)
        if first and isinstance(event, dict) and event.get("choices"):
            first = False
            on_first()
    return events


def test_a_stream_in_flight_at_sigterm_ends_whole_within_the_drain(stack: Stack) -> None:
    _restart_api(stack, 30.0)
    api = stack.api
    assert api is not None
    _, key = stack.tenant("drained-whole", allow_placement=True)
    signalled: list[float] = []

    def stop() -> None:
        metrics = httpx.get(stack.url + "/metrics", headers=ADMIN, timeout=10).text
        assert "prfaas_api_jobs_streaming 1.0" in metrics and "prfaas_api_draining 0.0" in metrics
        api.send_signal(signal.SIGTERM)
        signalled.append(time.monotonic())

    body = _body(30, True) | {"stream_options": {"include_usage": True}}
    with httpx.stream("POST", stack.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"},
                      timeout=60) as reply:  # fmt: skip
        events = _events(reply, stop)
    ended = time.monotonic()
    assert events[-1] == "[DONE]", events[-3:]
    assert not any(isinstance(e, dict) and "error" in e for e in events), events
    assert isinstance(events[-2], dict) and events[-2]["usage"]["completion_tokens"] == 30, events[-2]
    assert ended - signalled[0] > 1.0  # it went on well after the signal (30 tokens, 0.1 s each)
    api.wait(15)  # then the process exits on its own: nothing is left in flight


def test_a_stream_past_the_drain_ends_with_an_error_event_and_its_key_gets_a_fresh_job(stack: Stack) -> None:
    _restart_api(stack, 2.0)
    api = stack.api
    assert api is not None
    _, key = stack.tenant("drained-cut", allow_placement=True)
    headers = {"Authorization": f"Bearer {key}"}
    _, other = stack.tenant("drained-unary", allow_placement=True)  # its jobs listed apart from the stream's
    unary: list[httpx.Response] = []

    def answer() -> None:
        unary.append(httpx.post(stack.url + "/v1/completions", json=_body(200, False),
                                headers={"Authorization": f"Bearer {other}"}, timeout=60))  # fmt: skip

    unary_thread = threading.Thread(target=answer, daemon=True)
    signalled: list[float] = []

    def admitted() -> bool:
        jobs = httpx.get(stack.url + "/v1/jobs", headers={"Authorization": f"Bearer {other}"}, timeout=10).json()
        return len(jobs["data"]) == 1

    def stop() -> None:
        unary_thread.start()
        wait_until(admitted, 30, 0.05)  # in flight at the signal (not refused at the door)
        api.send_signal(signal.SIGTERM)
        signalled.append(time.monotonic())

    keyed = headers | {"Idempotency-Key": "drain-1"}
    with httpx.stream("POST", stack.url + "/v1/completions", json=_body(60, True), headers=keyed,
                      timeout=60) as reply:  # fmt: skip
        job_id = reply.headers["X-Prfaas-Job-Id"]
        events = _events(reply, stop)
    waited = time.monotonic() - signalled[0]
    print(f"stream ended {waited:.2f} s after SIGTERM, drain 2 s")
    error = events[-2]  # then [DONE], as vLLM ends a stream that failed
    assert isinstance(error, dict) and error["error"]["code"] == "server_shutting_down", events[-3:]
    assert sum(isinstance(e, dict) and bool(e.get("choices")) for e in events) < 60  # cut, not whole
    assert 1.8 < waited < 5.0  # the drain's time, not the stream's 6 s
    unary_thread.join(15)
    assert unary and unary[0].status_code == 503, unary[0].text[:2000] if unary else unary
    assert unary[0].json()["error"]["code"] == "server_shutting_down"
    assert unary[0].headers["Retry-After"] == "1"
    api.wait(15)  # the API exits once its streams ended

    for services in stack_services(stack):
        job = services.jobs.get(job_id)
        assert job["state"] == "CANCELED" and job["error"] == "canceled: server shutting down", job
        assert job.get("client_left") == "1"

    _restart_api(stack, 2.0)  # the retry at the next API process: a fresh job, run to its end
    retried = httpx.post(stack.url + "/v1/completions", json=_body(60, True), headers=keyed, timeout=60)
    assert retried.status_code == 200, retried.text
    assert retried.headers["X-Prfaas-Job-Id"] != job_id
    assert retried.text.rstrip().endswith("data: [DONE]")


def test_a_request_still_arriving_at_sigterm_is_refused_with_503(stack: Stack) -> None:
    """Its headers came before the signal, its body after: uvicorn lets it in; the API refuses it (no job)."""
    _restart_api(stack, 5.0)
    api = stack.api
    assert api is not None
    _, key = stack.tenant("drained-late", allow_placement=True)
    body = json.dumps(_body(3, False)).encode()
    port = int(stack.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {key}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")  # fmt: skip
        conn.sendall(head.encode() + body[:10])
        time.sleep(1.0)  # its headers read (uvicorn took the connection before it closed its listener)
        api.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        conn.sendall(body[10:])
        reply = b""
        while chunk := conn.recv(65536):
            reply += chunk
    status, _, rest = reply.partition(b"\r\n")
    assert status.startswith(b"HTTP/1.1 503"), reply[:300]
    assert json.loads(rest.partition(b"\r\n\r\n")[2])["error"]["code"] == "server_shutting_down"
    api.wait(15)
