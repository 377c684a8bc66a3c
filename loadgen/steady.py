"""Requests at a steady rate through the official `openai` client, each retried as a careful
tenant's program would retry it (bench/chaos.py, bench/soak.py): streaming, with an
`Idempotency-Key`, so that a retry after a broken stream or a lost connection attaches to the
same job instead of starting another (the API replays its tokens from the start). A request
ends when its stream delivers its final chunk, when the API answers with an error that names a
reason (a failed job, a refusal that is not worth retrying), or at its deadline (enforced within
an attempt too: a timer shuts a stream's connection there, whether it trickles tokens or keep-alive
comments). A stream that broke after its final chunk, before `[DONE]`, delivered the whole reply.
"""

from __future__ import annotations

import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
import openai

RETRY_PAUSE_S = 0.5  # between a broken stream and its retry
RETRIED_STATUSES = frozenset({429, 502, 503, 504})  # 503 without a job reason: the API restarting
READ_TIMEOUT_S = 60.0  # an attempt's longest wait for a byte (less when its deadline is nearer)
CONNECT_S = 5.0


@dataclass
class Asked:
    """One request and what its client saw."""

    index: int
    at_s: float  # planned start, from the run's start
    prompt: list[int]
    max_tokens: int
    key: str = field(default_factory=lambda: uuid.uuid4().hex)  # its Idempotency-Key
    job_id: str = ""
    text: str = ""
    finished: bool = False  # the final chunk (with its finish_reason) arrived
    error: str = ""  # the reason the API gave for a job it could not finish, or "deadline"
    breaks: int = 0  # streams that ended without their final chunk (each retried)
    retries: int = 0
    started_s: float = 0.0
    ended_s: float = 0.0


class _Cutoff:
    """Shuts a stream's connection at `deadline` from a timer thread: the blocked read returns at once. The
    deadline cannot wait for a chunk to check it at, nor for the read timeout: SSE keep-alive comments
    (`: ping`) carry no chunk and reset the read timeout. `cancel` before the stream is closed (a
    connection back in the pool is another request's)."""

    def __init__(self, response: httpx.Response, deadline: float) -> None:
        self._response = response
        self._lock = threading.Lock()
        self._live = True
        self._timer = threading.Timer(max(0.0, deadline - time.monotonic()), self._fire)
        self._timer.daemon = True
        self._timer.start()

    def _fire(self) -> None:
        with self._lock:
            if not self._live:
                return
            stream = self._response.extensions.get("network_stream")
            sock = stream.get_extra_info("socket") if stream is not None else None
            try:
                if isinstance(sock, socket.socket):
                    sock.shutdown(socket.SHUT_RDWR)  # wakes the reading thread (closing the socket would not)
                else:
                    self._response.close()
            except OSError:
                pass  # closed meanwhile

    def cancel(self) -> None:
        with self._lock:
            self._live = False
        self._timer.cancel()


def ask(client: openai.OpenAI, model: str, asked: Asked, deadline: float) -> None:
    """Run `asked` to its end (see the module docstring); never raises. An attempt's reads time out
    after the time left when it started (READ_TIMEOUT_S at most), and its stream's connection is shut
    at `deadline`, so `ask` returns by about twice the time left at the latest (a server silent before
    its headers: the deadline plus one read timeout); `error` is "deadline" when it ran out."""
    headers = {"Idempotency-Key": asked.key}
    while (left := deadline - time.monotonic()) > 0:
        text, final = "", False
        bounded = client.with_options(timeout=httpx.Timeout(min(READ_TIMEOUT_S, left), connect=min(CONNECT_S, left)))
        try:
            stream = bounded.completions.create(model=model, prompt=asked.prompt, max_tokens=asked.max_tokens,
                                                stream=True, extra_headers=headers)  # fmt: skip
            with stream:  # closes the connection when the deadline passes mid-stream
                cutoff = _Cutoff(stream.response, deadline)
                try:
                    for chunk in stream:
                        asked.job_id = chunk.id or asked.job_id
                        if chunk.choices:
                            text += chunk.choices[0].text
                            final = final or chunk.choices[0].finish_reason is not None
                        if time.monotonic() >= deadline:
                            break
                finally:
                    cutoff.cancel()
            if final:
                asked.text, asked.finished = text, True
                return
            if time.monotonic() >= deadline:
                break
            asked.breaks += 1
        except openai.APIStatusError as exc:
            if exc.status_code not in RETRIED_STATUSES or _job_reason(exc):
                asked.error = f"HTTP {exc.status_code}: {exc.message}"
                return
        except (openai.APIConnectionError, httpx.HTTPError):  # the API went away mid-call (or a read timed out)
            if final:  # after the final chunk, before [DONE]: the reply is whole, a retry would only replay it
                asked.text, asked.finished = text, True
                return
            if time.monotonic() >= deadline:
                break  # the cutoff shut it (or a read timed out at the deadline): not a broken stream
            asked.breaks += 1
        except openai.APIError as exc:  # an error event in the stream: the job ended without its tokens
            asked.error = exc.message or type(exc).__name__
            return
        asked.retries += 1
        time.sleep(max(0.0, min(RETRY_PAUSE_S, deadline - time.monotonic())))
    asked.error = "deadline"


def _job_reason(exc: openai.APIStatusError) -> bool:
    """Whether a 5xx names a job that ended (`job failed: ...`), not a server in trouble."""
    return exc.status_code in (503, 504) and "job " in (exc.message or "")


def run(
    api_base: str, api_key: str, model: str, requests: list[Asked], *, deadline_s: float,
    on_tick: Callable[[float], None] | None = None,
) -> None:  # fmt: skip
    """Start each request at its `at_s` on a thread of its own; return once all ended (each
    gives up `deadline_s` after its start). `on_tick(elapsed_s)` is called about every 0.05 s."""
    client = openai.OpenAI(base_url=api_base, api_key=api_key, max_retries=0,
                           timeout=httpx.Timeout(READ_TIMEOUT_S, connect=CONNECT_S))  # fmt: skip
    t0 = time.monotonic()
    threads: list[threading.Thread] = []

    def one(asked: Asked) -> None:
        asked.started_s = time.monotonic() - t0
        ask(client, model, asked, time.monotonic() + deadline_s)
        asked.ended_s = time.monotonic() - t0

    pending = sorted(requests, key=lambda a: a.at_s)
    while pending or any(t.is_alive() for t in threads):
        now = time.monotonic() - t0
        while pending and pending[0].at_s <= now:
            thread = threading.Thread(target=one, args=(pending.pop(0),), daemon=True)
            thread.start()
            threads.append(thread)
        if on_tick is not None:
            on_tick(now)
        time.sleep(0.05)
    client.close()
