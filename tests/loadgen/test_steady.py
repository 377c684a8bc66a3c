"""loadgen/steady.py (bench/soak.py, bench/chaos.py): a request's deadline bounds each attempt, not only the
gaps between attempts. Real HTTP on loopback: a server trickling a token every 0.1 s that never finishes, and one
that answers its headers and then says nothing (before, `ask` ran on for 1,000 tokens or the 60 s read timeout)."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler
from typing import Any

import httpx
import openai
from api_kit import event, fake_api, stream_events

from prfaas.loadgen import steady


def _trickle(handler: BaseHTTPRequestHandler, body: dict[str, Any]) -> None:
    stream_events(handler, (event("x") for _ in range(1000)), pause_s=0.1)  # 100 s of tokens, no finish_reason


def _silent(handler: BaseHTTPRequestHandler, body: dict[str, Any]) -> None:
    stream_events(handler, (event("x") for _ in range(1)), pause_s=30.0)  # one token, then 30 s of nothing


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
