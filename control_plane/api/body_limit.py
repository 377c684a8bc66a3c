"""`BodyLimit`: no request body over `max_bytes` (`Settings.max_body_bytes`) reaches a route. A declared
`Content-Length` over the cap is answered 413 before a byte of the body is read; a body without one
(chunked) is counted while it is read and refused as soon as it passes the cap, so neither is ever held
whole in memory nor parsed. A plain ASGI middleware (no task or memory streams per request)."""

from __future__ import annotations

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from prfaas.control_plane.api.errors import BODY_TOO_LARGE, ApiError, render


class BodyTooLarge(ApiError):
    """Raised from `receive` once the body passes the cap: FastAPI re-raises HTTP errors met while reading a
    body (`request.body()`, forms), so the app's handler renders it."""


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _error(self) -> BodyTooLarge:
        message = f"request body too large: more than {self.max_bytes} bytes"
        return BodyTooLarge(BODY_TOO_LARGE.status, message, BODY_TOO_LARGE.type, BODY_TOO_LARGE.code)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await render(Request(scope), self._error())(scope, receive, send)
            return
        seen = 0
        started = False

        async def counting_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise self._error()
            return message

        async def watching_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting_receive, watching_send)
        except BodyTooLarge as exc:  # read outside FastAPI's body parsing: answer here if nothing was sent yet
            if started:
                raise
            await render(Request(scope), exc)(scope, receive, send)
