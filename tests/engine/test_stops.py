"""Stop strings on incremental text (engine/stops.py), with a real tokenizer (SmolLM2's byte-level
BPE) where the cases need one: a stop string ending inside a token, one spanning tokens, a
character split across tokens."""

from __future__ import annotations

from typing import Any

import pytest
from transformers import AutoTokenizer

from prfaas.engine.models import prepare_model, resolve_model
from prfaas.engine.stops import Detokenizer, TextStops, output_text


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    prepare_model("smollm2-135m")
    return AutoTokenizer.from_pretrained(resolve_model("smollm2-135m"), local_files_only=True)


def _decode(tokenizer: Any) -> Any:
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


def _ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _run(tokenizer: Any, text: str, stop: list[str], min_tokens: int = 0) -> tuple[TextStops, int]:
    """Push `text`'s tokens until a stop string ends it: (the matcher, tokens pushed)."""
    stops = TextStops(_decode(tokenizer), stop, min_tokens)
    for n, token in enumerate(_ids(tokenizer, text), 1):
        if stops.push(token) is not None:
            return stops, n
    return stops, len(_ids(tokenizer, text))


def test_incremental_text_equals_decoding_all_at_once(tokenizer: Any) -> None:
    text = "Zürich, 東京 and naïve café ☕: déjà vu! 🎉🎉 done."
    ids = _ids(tokenizer, text)
    detok = Detokenizer(_decode(tokenizer))
    pieces = [detok.push(t) for t in ids]
    assert "".join(pieces) == detok.text == tokenizer.decode(ids) == text
    assert "" in pieces  # some character took more than one token: nothing shown until it was whole


def test_a_character_left_incomplete_at_the_end_is_not_shown(tokenizer: Any) -> None:
    ids = _ids(tokenizer, "ok 🎉")
    assert output_text(_decode(tokenizer), ids[:-1]) == "ok"  # the emoji's last byte never came
    assert output_text(_decode(tokenizer), ids) == "ok 🎉"


def test_stop_string_ending_inside_a_token_cuts_there(tokenizer: Any) -> None:
    stops, n = _run(tokenizer, " Paris is big", ["ari"])
    assert (stops.stopped, stops.text, n) == ("ari", " P", 1)  # " Paris" is one token


def test_stop_string_spanning_tokens_ends_at_the_token_completing_it(tokenizer: Any) -> None:
    stops, n = _run(tokenizer, "1, 2, 3, 4, 5, 6", ["3, 4"])
    assert stops.stopped == "3, 4" and stops.text == "1, 2, "
    assert n == len(_ids(tokenizer, "1, 2, 3, 4"))


def test_the_stop_string_completing_first_wins(tokenizer: Any) -> None:
    stops, _ = _run(tokenizer, "a b c d e", ["d", "b c"])
    assert (stops.stopped, stops.text) == ("b c", "a ")


def test_no_stop_string_before_min_tokens(tokenizer: Any) -> None:
    # "1, 2, 3": tokens 1 "," " " 2 "," ...: with min_tokens 3 the first "," (token 2) does not count
    stops, n = _run(tokenizer, "1, 2, 3", [","], min_tokens=3)
    assert (stops.text, n) == ("1, 2", 5)


def test_streaming_holds_back_what_could_start_a_stop_string(tokenizer: Any) -> None:
    stops = TextStops(_decode(tokenizer), ["END!"])
    shown = []
    for token in _ids(tokenizer, "one two EN"):
        stops.push(token)
        shown.append(stops.visible(finished=False))
    assert shown[-1] == "one two"  # the last 3 characters (" EN") could still start "END!"
    assert stops.visible(finished=True) == "one two EN"
