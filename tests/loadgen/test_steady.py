"""loadgen/steady.py (bench/soak.py, bench/chaos.py): a request's deadline bounds each attempt, not only the
gaps between attempts. Real HTTP on loopback: a server trickling a token every 0.1 s that never finishes, and one
that answers its headers and then says nothing (before, `ask` ran on for 1,000 tokens or the 60 s read timeout),
one that sends keep-alive comments after a token (before: each reset the read timeout and carried no chunk to
check the deadline at), and a stream broken after its final chunk (a whole reply: not retried)."""

from __future__ import annotations

import itertools
import json
import re
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler
from typing import Any

import httpx
import openai
from api_kit import _chunk, event, fake_api, stream_events

from prfaas.loadgen import steady


def _trickle(handler: BaseHTTPRequestHandler, body: dict[str, Any]) -> None:
    stream_events(handler, (event("x") for _ in range(1000)), pause_s=0.1)  # 100 s of tokens, no finish_reason


def _silent(handler: BaseHTTPRequestHandler, body: dict[str, Any]) -> None:
    stream_events(handler, (event("x") for _ in range(1)), pause_s=30.0)  # one token, then 30 s of nothing


def _open_stream(handler: BaseHTTPRequestHandler, first: dict[str, Any]) -> None:
    handler.send_response(200)
    handler.send_header("Content-Type", "text/event-stream")
    handler.send_header("Transfer-Encoding", "chunked")
    handler.end_headers()
    _chunk(handler, f"data: {json.dumps(first)}\n\n".encode())


def _pinging(handler: BaseHTTPRequestHandler, body: dict[str, Any]) -> None:
    # one token, then 8 s of SSE keep-alive comments 0.1 s apart: bytes keep coming, no chunk does
    try:
        _open_stream(handler, event("x"))
        for _ in range(80):
            _chunk(handler, b": ping\n\n")
            time.sleep(0.1)
    except (BrokenPipeError, ConnectionResetError):
        pass


def _ask_within(url: str, deadline_s: float, wait_s: float) -> tuple[steady.Asked, float, bool]:
    client = openai.OpenAI(base_url=url, api_key="k", max_retries=0, timeout=httpx.Timeout(60.0, connect=5.0))
    asked = steady.Asked(0, 0.0, [1, 2, 3], 4)
    start = time.monotonic()
    thread = threading.Thread(target=steady.ask, args=(client, "m", asked, start + deadline_s), daemon=True)
    thread.start()
    thread.join(wait_s)
    return asked, time.monotonic() - start, thread.is_alive()


def test_a_stream_that_trickles_forever_ends_at_the_deadline() -> None:
    with fake_api(_trickle) as api:
        asked, took_s, running = _ask_within(api.url, 1.0, 5.0)
    assert not running, "ask() ran past its deadline"
    assert took_s < 2.0  # the deadline (1 s) plus at most one 0.1 s gap between chunks
    assert (asked.finished, asked.error) == (False, "deadline")


def test_a_silent_server_times_out_by_the_time_left_not_the_60_s_read_timeout() -> None:
    with fake_api(_silent) as api:
        asked, took_s, running = _ask_within(api.url, 1.0, 5.0)
    assert not running, "ask() waited on a silent stream past its deadline"
    assert took_s < 3.0  # at most the deadline plus one read timeout of the time left (1 s)
    assert (asked.finished, asked.error) == (False, "deadline")


def test_run_returns_once_every_request_met_its_deadline() -> None:
    with fake_api(_trickle) as api:
        asked = [steady.Asked(i, 0.1 * i, [1, 2, 3], 4) for i in range(3)]
        start = time.monotonic()
        done = threading.Thread(target=steady.run, args=(api.url, "k", "m", asked), kwargs={"deadline_s": 1.0},
                                daemon=True)  # fmt: skip
        done.start()
        done.join(6.0)
    assert not done.is_alive() and time.monotonic() - start < 6.0
    assert [a.error for a in asked] == ["deadline"] * 3


def test_keep_alive_comments_do_not_keep_a_stream_past_its_deadline() -> None:
    with fake_api(_pinging) as api:
        asked, took_s, running = _ask_within(api.url, 1.0, 5.0)
    assert not running, "ask() ran past its deadline on a stream of keep-alive comments"
    assert took_s < 2.0  # the deadline (1 s), not the 8 s of comments
    assert (asked.finished, asked.error, asked.breaks) == (False, "deadline", 0)  # cut at the deadline: no break


def test_a_stream_broken_after_its_final_chunk_finished() -> None:
    calls: list[int] = []

    def final_then_cut(handler: BaseHTTPRequestHandler, body: dict[str, Any]) -> None:
        calls.append(1)
        if len(calls) > 1:  # a retry would find the API restarting until the deadline
            handler.send_error(503, "restarting")
            return
        _open_stream(handler, event("ab", "length"))  # the whole reply and its finish_reason ...
        handler.connection.shutdown(socket.SHUT_RDWR)  # ... then the connection drops before [DONE]

    with fake_api(final_then_cut) as api:
        asked, _, running = _ask_within(api.url, 2.0, 5.0)
    assert not running
    assert (asked.finished, asked.text, asked.error) == (True, "ab", "")
    assert (asked.breaks, asked.retries, len(calls)) == (0, 0, 1)  # not retried


def test_on_tick_is_called_as_often_as_run_says() -> None:
    # the docstring's "about every X s" is what bench/chaos.py and bench/soak.py schedule by (it said 0.1 s; the
    # loop ticks every 0.05 s)
    stated = re.search(r"about every ([0-9.]+) s", steady.run.__doc__ or "")
    assert stated, "run's docstring states how often on_tick is called"
    ticks: list[float] = []
    with fake_api(lambda handler, body: (time.sleep(0.5), stream_events(handler, [event("a", "length")]))) as api:
        steady.run(api.url, "k", "m", [steady.Asked(0, 0.0, [1, 2], 1)], deadline_s=5.0, on_tick=ticks.append)
    gaps = sorted(b - a for a, b in itertools.pairwise(ticks))
    assert float(stated[1]) * 0.8 <= gaps[len(gaps) // 2] <= float(stated[1]) * 1.5, gaps
