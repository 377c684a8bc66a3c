"""The `stream=false` response (`AnswerResponse`): the answer is built (its jobs' tokens read to their end) on
a worker thread while the client is listened to. A client that goes away first ends the request's jobs at once,
as vLLM aborts a request whose client left, instead of leaving them to run to their end for no one, billed."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import anyio
import anyio.to_thread
from fastapi.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from prfaas.control_plane.api import threads
from prfaas.control_plane.api.errors import ApiError

log = logging.getLogger(__name__)


class AnswerResponse(Response):
    """`build()` gives the JSON body; `gone()` is called (on a worker thread) when the client disconnects
    before it is ready, and the answer is then dropped. An error raised by `build` (say, a job that ended
    without its tokens) reaches the app's error handlers as if the route had raised it."""

    def __init__(self, build: Callable[[], dict[str, Any]], gone: Callable[[], None], headers: dict[str, str]) -> None:
        super().__init__()
        self.build = build
        self.answer_headers = headers
        self.gone = gone

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        left = False

        async def listen() -> None:
            nonlocal left
            while (await receive())["type"] != "http.disconnect":  # the body was read: only its end can come
                pass
            left = True
            # the build's jobs end, and with them `build` (soon); on threads of its own (api/threads.py)
            await anyio.to_thread.run_sync(self.gone, limiter=threads.gone())

        content: dict[str, Any] | None = None
        error: BaseException | None = None
        async with anyio.create_task_group() as group:
            group.start_soon(listen)
            try:
                content = await anyio.to_thread.run_sync(self.build, limiter=threads.waiting(scope))
            except Exception as exc:  # raised after the group, not as an ExceptionGroup from it
                error = exc
            group.cancel_scope.cancel()  # `gone`, when running, ends first (a thread is not cancelled)
        if left:
            log.info("client went away before its answer was ready: %s", error or "answer dropped")
            return
        if error is not None:
            if isinstance(error, ApiError):  # a job that failed: its id, to look its timeline up
                error.headers = {**(error.headers or {}), **self.answer_headers}
            raise error
        await JSONResponse(content, headers=self.answer_headers)(scope, receive, send)
