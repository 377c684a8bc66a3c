"""The streamed response's end, on Starlette itself (no server): a client gone before the first chunk was
asked for leaves a generator that never started, and the response says so (`unstarted`), so that the
request's jobs are ended rather than left followed and never read; a stream read to its end does not."""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import anyio

from prfaas.control_plane.api.sse import ClosingStreamingResponse

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
