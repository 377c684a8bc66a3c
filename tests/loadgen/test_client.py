"""loadgen/client.py against a fake API on loopback (real HTTP, real `openai` client): a reply counts as completed
only when its stream delivered a finish_reason; a conversation's later turns arrive, in the trace, when they were
sent, not all at the conversation's start."""

from __future__ import annotations

import itertools
from http.server import BaseHTTPRequestHandler
from typing import Any

import pytest
from api_kit import answer, event, fake_api, stream_events

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
