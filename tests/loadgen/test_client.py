"""loadgen/client.py against a fake API on loopback (real HTTP, real `openai` client): a reply counts as completed
only when its stream delivered a finish_reason (a connection lost after that chunk loses nothing); a conversation's
later turns arrive, in the trace, when they were sent, not all at the conversation's start, and every planned turn
is an outcome; the connection pool holds every request in flight."""

from __future__ import annotations

import itertools
import json
import socket
from http.server import BaseHTTPRequestHandler
from typing import Any

import httpx
import pytest
from api_kit import _chunk, answer, event, fake_api, stream_events

from prfaas.loadgen import client, report
from prfaas.loadgen.conversations import Conversation
from prfaas.loadgen.workload import Planned

REQUEST = Planned(0, 0.0, "fixed", (1, 2, 3), 16, None, 0)


def _cut_short(handler: BaseHTTPRequestHandler, body: dict[str, Any]) -> None:
    # one token of the 16 asked, then the body ends cleanly: no finish_reason, no [DONE] (a proxy cut it)
    stream_events(handler, [event("x")], done=False)


def test_a_stream_that_ends_without_a_finish_reason_failed() -> None:
    with fake_api(_cut_short) as api:
        outcomes, wall_s = client.run(api.url, "k", "m", [REQUEST], concurrency=1, timeout_s=10)
    (cut,) = outcomes
    assert (cut.ok, cut.error, cut.text) == (False, "stream ended without finish_reason", "x")
    summary = report.summarize(outcomes, wall_s, 2.0, 0.2)
    assert (summary["completed"], summary["failed"], summary["goodput"]["requests_in_slo"]) == (0, 1, 0)


def test_a_stream_with_its_finish_reason_completed() -> None:
    with fake_api(answer) as api:
        (whole,), _ = client.run(api.url, "k", "m", [REQUEST], concurrency=1, timeout_s=10)
    assert (whole.ok, whole.error, whole.text, whole.output_tokens) == (True, None, "ab", 2)


def _whole_then_cut(handler: BaseHTTPRequestHandler, body: dict[str, Any]) -> None:
    # "a", then "b" with its finish_reason, then the connection drops: no usage chunk, no [DONE]
    handler.send_response(200)
    handler.send_header("Content-Type", "text/event-stream")
    handler.send_header("Transfer-Encoding", "chunked")
    handler.end_headers()
    for item in (event("a"), event("b", "length")):
        _chunk(handler, f"data: {json.dumps(item)}\n\n".encode())
    handler.connection.shutdown(socket.SHUT_RDWR)


def test_a_stream_cut_after_its_finish_reason_completed() -> None:
    # docs/operations.md: completed when a token streamed and a chunk carried its finish_reason (before: failed,
    # RemoteProtocolError, no latency, although the reply was whole)
    with fake_api(_whole_then_cut) as api:
        (whole,), _ = client.run(api.url, "k", "m", [REQUEST], concurrency=1, timeout_s=10)
    assert (whole.ok, whole.error, whole.text, whole.output_tokens) == (True, None, "ab", 2)  # no usage: the pieces
    assert whole.latency_s is not None and whole.ttft_s is not None and whole.latency_s >= whole.ttft_s


def test_later_turns_arrive_in_the_trace_when_they_were_sent() -> None:
    # one conversation of 3 turns starting at 0.2 s, 0.3 s of thinking between a reply and the next turn: the
    # trace (what `prfaas sim run --trace` replays) has them at 0.2 s, then each at its send time, >= 0.3 s
    # apart (before: all three at 0.2 s, a burst)
    conversation = Conversation(0, 0.2, (1, 2, 3), ((4, 5), (6, 7), (8, 9)), (4, 4, 4))
    with fake_api(answer) as api:
        outcomes, _ = client.run_conversations(api.url, "k", "m", [conversation], "auto", None, 10.0,
                                               lambda text: [1] * len(text), 2048, think_s=0.3)  # fmt: skip
    assert [o.ok for o in outcomes] == [True] * 3
    t_s = [row["t_s"] for row in report.trace_rows("prfaas", outcomes)]
    assert t_s[0] == 0.2
    assert all(b - a > 0.29 for a, b in itertools.pairwise(t_s)), t_s
    assert [o.at_s for o in outcomes[1:]] == pytest.approx([o.sent_s for o in outcomes[1:]], abs=0.01)


def _fail_first_turn(handler: BaseHTTPRequestHandler, body: dict[str, Any]) -> None:
    stream_events(handler, [], done=False)  # no token at all: turn 0 fails


def test_the_turns_a_failed_turn_left_unsent_arrive_after_it_not_at_the_start() -> None:
    conversation = Conversation(0, 0.2, (1, 2, 3), ((4, 5), (6, 7), (8, 9)), (4, 4, 4))
    with fake_api(_fail_first_turn) as api:
        outcomes, _ = client.run_conversations(api.url, "k", "m", [conversation], "auto", None, 10.0,
                                               lambda text: [1] * len(text), 2048, think_s=0.3)  # fmt: skip
    assert [o.error for o in outcomes][1:] == ["not sent: turn 0 of its conversation failed"] * 2
    t_s = [row["t_s"] for row in report.trace_rows("prfaas", outcomes)]
    assert t_s[0] == 0.2 and all(b - a > 0.29 for a, b in itertools.pairwise(t_s)), t_s


def test_the_turns_of_a_conversation_that_outgrew_the_context_count_as_failed() -> None:
    # system 3 + user 2 + max_tokens 4 = 9 tokens fit a 12-token model; turn 1 re-sends 3 + 2 + the reply "ab"
    # (2) + 2 and asks 4 more: 13, too long. Turns 1 and 2 are outcomes (before: missing, `requests` < -n)
    conversation = Conversation(0, 0.0, (1, 2, 3), ((4, 5), (6, 7), (8, 9)), (4, 4, 4))
    with fake_api(answer) as api:
        outcomes, wall_s = client.run_conversations(api.url, "k", "m", [conversation], "auto", None, 10.0,
                                                    lambda text: [1] * len(text), 12, think_s=0.0)  # fmt: skip
    outgrew = "not sent: the conversation outgrew the model's context"
    assert [(o.klass, o.ok, o.error) for o in outcomes] == [("turn0", True, None), ("turn1", False, outgrew),
                                                            ("turn2", False, outgrew)]  # fmt: skip
    assert [o.prompt_tokens for o in outcomes[1:]] == [9, 11]  # at least the history and the user messages
    summary = report.summarize(outcomes, wall_s, 2.0, 0.2)
    assert (summary["requests"], summary["completed"], summary["failed"]) == (3, 1, 2)


@pytest.mark.parametrize(("concurrency", "connections"), [(None, None), (3, 3)])
def test_the_connection_pool_holds_every_request_in_flight(
    monkeypatch: pytest.MonkeyPatch, concurrency: int | None, connections: int | None
) -> None:
    # open loop: no cap (before: 1,024 requests, 256 conversations; past them a request waited in the client for
    # a connection and its TTFT counted the wait); closed loop: `concurrency` requests in flight, as many connections
    pools: list[int | None] = []

    class Recording(httpx.AsyncClient):
        def __init__(self, *args: Any, limits: httpx.Limits, **kwargs: Any) -> None:
            pools.append(limits.max_connections)
            super().__init__(*args, limits=limits, **kwargs)

    monkeypatch.setattr(client.httpx, "AsyncClient", Recording)
    conversation = Conversation(0, 0.0, (1, 2, 3), ((4, 5),), (4,))
    with fake_api(answer) as api:
        (single,), _ = client.run(api.url, "k", "m", [REQUEST], concurrency=concurrency, timeout_s=10)
        (turn,), _ = client.run_conversations(api.url, "k", "m", [conversation], "auto", concurrency, 10.0,
                                              lambda text: [1] * len(text), 2048, think_s=0.0)  # fmt: skip
    assert single.ok and turn.ok
    assert pools == [connections, connections]
