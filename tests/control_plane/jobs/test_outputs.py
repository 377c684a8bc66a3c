"""A job's output as its follower keeps it (jobs/tokenlog.py `Outputs`): tokens by choice, a new
attempt's repeats skipped, DONE once every choice ended, and the record a late reader replays."""

from __future__ import annotations

import json

from prfaas.control_plane.jobs.tokenlog import Outputs, Token, recorded_tokens
from prfaas.engine.sampling import TokenLogprobs


def test_one_choice_records_as_before() -> None:
    out = Outputs([Token(0, 5, False, ""), Token(1, 6, False, "")])
    assert not out.add(Token(1, 6, False, ""))  # a new attempt streams it again: skipped
    assert out.add(Token(2, 7, True, "stop", "x"))
    assert out.done(1) and out.count == 3
    record = out.record()
    assert record == {"completion_tokens": 3, "output_ids": [5, 6, 7], "finish_reason": "stop", "stop_reason": "x"}
    job = {k: json.dumps(v) if isinstance(v, list) else str(v) for k, v in record.items()}
    assert [(t.token, t.last, t.finish_reason) for t in recorded_tokens(job)] == [(5, False, ""), (6, False, ""),
                                                                                  (7, True, "stop")]  # fmt: skip


def test_n_choices_end_when_every_one_ended() -> None:
    out = Outputs(())
    for token in (
        Token(0, 1, False, "", choice=0),
        Token(0, 2, False, "", choice=1),
        Token(1, 3, True, "eos", choice=1),
    ):
        out.add(token)
    assert not out.done(2)
    out.add(Token(1, 4, True, "length", choice=0))
    assert out.done(2) and out.count == 4
    record = out.record()
    assert record["output_ids"] == [[1, 4], [2, 3]] and record["finish_reasons"] == ["length", "eos"]
    job = {k: json.dumps(v) if isinstance(v, list) else str(v) for k, v in record.items()}
    assert [(t.choice, t.index, t.token, t.last) for t in recorded_tokens(job)] == [
        (0, 0, 1, False), (0, 1, 4, True), (1, 0, 2, False), (1, 1, 3, True)]  # fmt: skip


def test_log_entries_round_trip_with_logprobs_and_choice() -> None:
    token = Token(3, 9, True, "stop_token", "9", TokenLogprobs(-0.5, 2, (4, 9), (-0.1, -0.5)), choice=2)
    assert Token.of_entry(17, token.entry()) == token
    assert Token.of_entry(4, json.dumps([9, 0, ""])) == Token(4, 9, False, "")  # an entry of an older API process
