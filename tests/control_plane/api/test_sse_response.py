"""The streamed response's end, on Starlette itself (no server): a client gone before the first chunk was
asked for leaves a generator that never started, and the response says so (`unstarted`), so that the
request's jobs are ended rather than left followed and never read; a stream read to its end does not. A
`stream=false` answer's client gone is told at once, however busy the worker threads."""

from __future__ import annotations

import threading
import time
from collections.abc import Generator
from typing import Any

import anyio

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
    response = ClosingStreamingResponse(_body(started), unstarted=lambda: gone.append(True))

    async def receive() -> dict[str, Any]:
        return {"type": "http.disconnect"}  # gone at once

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            await anyio.sleep(0.2)  # the disconnect is seen before the first chunk is asked for

    anyio.run(response, SCOPE, receive, send)
    assert (started, gone) == ([], [True])


def test_a_stream_read_to_its_end_is_not_unstarted() -> None:
    started: list[bool] = []
    gone: list[bool] = []
    sent: list[bytes] = []
    response = ClosingStreamingResponse(_body(started), unstarted=lambda: gone.append(True))

    async def receive() -> dict[str, Any]:
        await anyio.sleep_forever()
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        sent.append(message.get("body", b""))

    anyio.run(response, SCOPE, receive, send)
    assert started == [True] and gone == [] and b"".join(sent) == b"data: one\n\ndata: [DONE]\n\n"


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
