"""The streamed response's end, on Starlette itself (no server): a client gone before the first chunk was
asked for leaves a generator that never started, and the response says so (`unstarted`), so that the
request's jobs are ended rather than left followed and never read; a stream read to its end does not. A
client gone while its stream waits for a token is told at once (`gone`), not at the token. A `stream=false`
answer's client gone is told at once, however busy the worker threads, and answers and streams waiting on
their jobs take no thread of the default pool, which the sync routes and health probes run on."""

from __future__ import annotations

import threading
import time
from collections.abc import Generator
from types import SimpleNamespace
from typing import Any

import anyio
import pytest
from prometheus_client import CollectorRegistry

from prfaas.control_plane.api.metrics import ApiMetrics
from prfaas.control_plane.api.sse import ClosingStreamingResponse
from prfaas.control_plane.api.unary import AnswerResponse

SCOPE = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}}  # uvicorn's


def _body(started: list[bool]) -> Generator[str, None, None]:
    started.append(True)
    yield "data: one\n\n"
    yield "data: [DONE]\n\n"


def test_a_client_gone_before_the_first_chunk_is_told_to_unstarted() -> None:
    started: list[bool] = []
    gone: list[bool] = []
    told: list[bool] = []
    response = ClosingStreamingResponse(_body(started), gone=lambda: told.append(True),
                                        unstarted=lambda: gone.append(True))  # fmt: skip

    async def receive() -> dict[str, Any]:
        return {"type": "http.disconnect"}  # gone at once

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            await anyio.sleep(0.2)  # the disconnect is seen before the first chunk is asked for

    anyio.run(response, SCOPE, receive, send)
    assert (started, gone, told) == ([], [True], [True])


def test_a_stream_read_to_its_end_is_not_unstarted() -> None:
    started: list[bool] = []
    gone: list[bool] = []
    sent: list[bytes] = []
    response = ClosingStreamingResponse(_body(started), gone=lambda: gone.append(True),
                                        unstarted=lambda: gone.append(True))  # fmt: skip

    async def receive() -> dict[str, Any]:
        await anyio.sleep_forever()
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        sent.append(message.get("body", b""))

    anyio.run(response, SCOPE, receive, send)
    assert started == [True] and gone == [] and b"".join(sent) == b"data: one\n\ndata: [DONE]\n\n"


def test_a_client_gone_while_its_stream_waits_for_a_token_is_told_at_once() -> None:
    """The job's first token would come at 3 s (a long prefill); the client leaves at 0.2 s: `gone` (which ends
    the job, and with it the wait) is called then, and the response ends with it."""
    canceled = threading.Event()
    told: list[float] = []
    started = time.monotonic()

    def body() -> Generator[str, None, None]:
        canceled.wait(3.0)  # the wait for the first token, until the job ends
        yield "data: one\n\n"

    def gone() -> None:
        told.append(time.monotonic() - started)
        canceled.set()

    response = ClosingStreamingResponse(body(), gone=gone, unstarted=lambda: None)

    async def receive() -> dict[str, Any]:
        await anyio.sleep(0.2)
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        pass

    anyio.run(response, SCOPE, receive, send)
    assert len(told) == 1 and told[0] < 1.0 and time.monotonic() - started < 2.0, told


def test_waits_on_jobs_take_no_thread_of_the_default_pool() -> None:
    """Three answers and three streams wait on their jobs while the default pool has 2 threads (40 in a real
    process): a sync route (a thread of the default pool) still runs at once."""
    release = threading.Event()
    route_s: list[float] = []

    def waiting_body() -> Generator[str, None, None]:
        release.wait(5.0)
        yield "data: [DONE]\n\n"

    async def receive() -> dict[str, Any]:
        await anyio.sleep_forever()
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        pass

    async def main() -> None:
        anyio.to_thread.current_default_thread_limiter().total_tokens = 2
        async with anyio.create_task_group() as group:
            for _ in range(3):
                answer = AnswerResponse(lambda: (release.wait(5.0), {})[1], lambda: None, {})
                group.start_soon(answer, SCOPE, receive, send)
                stream = ClosingStreamingResponse(waiting_body(), gone=lambda: None, unstarted=lambda: None)
                group.start_soon(stream, SCOPE, receive, send)
            await anyio.sleep(0.3)  # all six wait
            started = time.monotonic()
            await anyio.to_thread.run_sync(lambda: None)  # a sync route, say /readyz
            route_s.append(time.monotonic() - started)
            release.set()
            group.cancel_scope.deadline = anyio.current_time() + 5.0

    anyio.run(main)
    assert route_s and route_s[0] < 1.0, route_s


def test_a_stream_false_client_gone_under_load_is_told_at_once() -> None:
    """`stream=false` (api/unary.py): every default worker thread builds an answer (2 here, for the 40), and both
    clients leave at 0.2 s: their jobs are ended then, not when an answer ends (it waited for a default thread:
    3 s here)."""
    told: list[float] = []

    async def main() -> None:
        anyio.to_thread.current_default_thread_limiter().total_tokens = 2
        started = time.monotonic()

        async def one() -> None:
            canceled = threading.Event()

            def build() -> dict[str, Any]:
                canceled.wait(3.0)  # the job runs until its client's cancel, or 3 s
                return {}

            def gone() -> None:
                told.append(time.monotonic() - started)
                canceled.set()

            async def receive() -> dict[str, Any]:
                await anyio.sleep(0.2)
                return {"type": "http.disconnect"}

            async def send(message: dict[str, Any]) -> None:
                raise AssertionError("nothing is sent to a client gone")

            await AnswerResponse(build, gone, {})(SCOPE, receive, send)

        async with anyio.create_task_group() as group:
            for _ in range(2):
                group.start_soon(one)

    anyio.run(main)
    assert len(told) == 2 and max(told) < 1.0, told


def test_an_error_of_the_stream_itself_is_raised_as_it_is() -> None:
    """An OSError from the generator (a TLS file unreadable, a socket timeout) is the server's error, raised as
    it is (not swallowed as if the client had gone, nor wrapped in an ExceptionGroup)."""

    def body() -> Generator[str, None, None]:
        yield "data: one\n\n"
        raise TimeoutError("region did not answer")

    response = ClosingStreamingResponse(body(), gone=lambda: None, unstarted=lambda: None)
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        await anyio.sleep_forever()
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    with pytest.raises(TimeoutError, match="region did not answer"):
        anyio.run(response, SCOPE, receive, send)
    # the response is not ended as if complete (its client sees a broken stream, not a short one)
    assert [m.get("more_body") for m in sent if m["type"] == "http.response.body"] == [True], sent


def test_a_client_that_leaves_after_the_last_chunk_ended_nothing() -> None:
    """The client closes once it read `[DONE]`, before the response's last (empty) message went out: its jobs
    have ended, `gone` is not called (it cost Redis round trips and a thread for nothing)."""
    told: list[bool] = []
    last_sent = anyio.Event()
    response = ClosingStreamingResponse(_body([]), gone=lambda: told.append(True), unstarted=lambda: None)

    async def receive() -> dict[str, Any]:
        await last_sent.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            last_sent.set()
            await anyio.sleep(0.3)  # the disconnect is seen while the last message goes out

    anyio.run(response, SCOPE, receive, send)
    assert told == []


def test_the_requests_waiting_and_queued_for_a_waiting_thread_are_gauged() -> None:
    """`prfaas_api_waiting_requests` / `prfaas_api_waiting_queued`: with `max_waiting_requests` 1, of three answers
    waiting on their jobs one holds the waiting thread and two queue for it; none once they ended."""
    registry = CollectorRegistry()
    metrics = ApiMetrics(registry)
    app = SimpleNamespace(state=SimpleNamespace(settings=SimpleNamespace(max_waiting_requests=1), api_metrics=metrics))
    release = threading.Event()
    seen: list[tuple[float | None, float | None]] = []

    def gauges() -> tuple[float | None, float | None]:
        return registry.get_sample_value("prfaas_api_waiting_requests"), registry.get_sample_value(
            "prfaas_api_waiting_queued"
        )

    async def receive() -> dict[str, Any]:
        await anyio.sleep_forever()
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        pass

    async def main() -> None:
        async with anyio.create_task_group() as group:
            for _ in range(3):
                answer = AnswerResponse(lambda: (release.wait(5.0), {})[1], lambda: None, {})
                group.start_soon(answer, SCOPE | {"app": app}, receive, send)
            await anyio.sleep(0.3)
            seen.append(await anyio.to_thread.run_sync(gauges))  # read from another thread, as a scrape does
            release.set()
        seen.append(gauges())

    anyio.run(main)
    assert seen == [(1.0, 2.0), (0.0, 0.0)]


@pytest.mark.parametrize("keepalive_s", [0.25, 0.0])
def test_a_stream_with_nothing_to_send_gets_keep_alive_comments(keepalive_s: float) -> None:
    """The first token comes at 1.1 s (a job queued, a long prefill): every 0.25 s without a chunk, an SSE
    comment goes out, and none once chunks flow; `sse_keepalive_s` 0 sends none."""
    sent: list[bytes] = []

    def body() -> Generator[str, None, None]:
        time.sleep(1.1)
        yield "data: one\n\n"
        yield "data: [DONE]\n\n"

    response = ClosingStreamingResponse(body(), gone=lambda: None, unstarted=lambda: None, keepalive_s=keepalive_s)

    async def receive() -> dict[str, Any]:
        await anyio.sleep_forever()
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body":
            sent.append(message["body"])

    anyio.run(response, SCOPE, receive, send)
    comments, data = sent[:-3], sent[-3:]  # the last: the response's end
    assert data == [b"data: one\n\n", b"data: [DONE]\n\n", b""], sent
    assert set(comments) <= {b": keep-alive\n\n"}, sent
    assert (3 <= len(comments) <= 5) if keepalive_s else not comments, sent  # 4 on an idle machine
