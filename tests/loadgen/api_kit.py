"""A fake OpenAI completions API on loopback for the load generator's tests: a real HTTP/1.1 server whose
`POST /v1/completions` answers with whatever `reply(handler, body)` writes (SSE events in chunked encoding,
`stream_events`), `GET /v1/models` serving one model "m", and a 404 for anything else (a deployment with no
job store nor ledger: `attach_jobs` leaves the outcomes as measured)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

Reply = Callable[[BaseHTTPRequestHandler, dict[str, Any]], None]


def event(text: str, finish_reason: str | None = None, job_id: str = "job-1") -> dict[str, Any]:
    """One streamed completion chunk."""
    return {"id": job_id, "object": "text_completion", "created": 0, "model": "m",
            "choices": [{"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}]}  # fmt: skip


def stream_events(
    handler: BaseHTTPRequestHandler, events: Iterator[dict[str, Any]] | list[dict[str, Any]], *,
    pause_s: float = 0.0, done: bool = True,
) -> None:  # fmt: skip
    """A 200 SSE stream of `events`, `pause_s` apart, then `[DONE]` when `done`, then the body's end. A client
    that hangs up ends it quietly."""
    handler.send_response(200)
    handler.send_header("Content-Type", "text/event-stream")
    handler.send_header("Transfer-Encoding", "chunked")
    handler.end_headers()
    try:
        for item in events:
            _chunk(handler, f"data: {json.dumps(item)}\n\n".encode())
            time.sleep(pause_s)
        if done:
            _chunk(handler, b"data: [DONE]\n\n")
        handler.wfile.write(b"0\r\n\r\n")
        handler.wfile.flush()
    except (BrokenPipeError, ConnectionResetError):
        pass


def answer(handler: BaseHTTPRequestHandler, body: dict[str, Any], text: str = "ab") -> None:
    """A complete reply: a chunk per character, the last with finish_reason "length", then `[DONE]`."""
    stream_events(handler, [event(c, "length" if i == len(text) - 1 else None) for i, c in enumerate(text)])


def _chunk(handler: BaseHTTPRequestHandler, data: bytes) -> None:
    handler.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
    handler.wfile.flush()


class FakeApi:
    def __init__(self, reply: Reply) -> None:
        self.reply = reply
        self.bodies: list[dict[str, Any]] = []  # every completion request, as received
        api = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                api.bodies.append(body)
                api.reply(self, body)
                self.close_connection = True

            def do_GET(self) -> None:
                found = self.path == "/v1/models"
                payload = json.dumps({"data": [{"id": "m"}]} if found else {"detail": "Not Found"}).encode()
                self.send_response(200 if found else 404)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_port}/v1"


@contextmanager
def fake_api(reply: Reply) -> Iterator[FakeApi]:
    api = FakeApi(reply)
    thread = threading.Thread(target=api.server.serve_forever, daemon=True)
    thread.start()
    try:
        yield api
    finally:
        api.server.shutdown()
        api.server.server_close()
