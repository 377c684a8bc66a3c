"""How a choice's stream ends (decode_region/tokens.py `TokenStream.finish`), in vLLM's order (v1
`check_stop`: end of sequence, then a stop token id, then length; then its detokenizer's stop strings,
which win over length). Before, the last token `max_tokens` allowed was `length` even when it was the
end of sequence or a stop token id, and its text was shown; vLLM answers `stop` there."""

from __future__ import annotations

import pytest

from prfaas.decode_region.tokens import TokenStream
from prfaas.engine.base import ModelFacts
from prfaas.engine.sampling import Chosen, SamplingParams
from prfaas.engine.stops import TextStops

EOS = 2
EOT = 3  # an end of sequence of the generation config's besides the tokenizer's
TEXT = {5: "a", 6: "b", 7: "!", EOS: "", EOT: ""}
FACTS = ModelFacts("f" * 64, "float32", 1000, 2, 2, 4, 4096, frozenset({EOS, EOT}), eos_token_id=EOS)


def _decode(ids: list[int]) -> str:
    return "".join(TEXT[i] for i in ids)


@pytest.mark.parametrize(
    ("token", "index", "params", "expected"),
    [
        (EOS, 1, SamplingParams(max_new_tokens=2), ("eos", "")),  # at the limit: still the end of sequence
        (EOS, 0, SamplingParams(max_new_tokens=2), ("eos", "")),
        (EOS, 1, SamplingParams(max_new_tokens=2, ignore_eos=True), ("length", "")),
        (7, 1, SamplingParams(max_new_tokens=2, stop_token_ids=(7,)), ("stop_token", "7")),  # at the limit
        (7, 0, SamplingParams(max_new_tokens=2, stop_token_ids=(7,)), ("stop_token", "7")),
        (5, 1, SamplingParams(max_new_tokens=2, stop_token_ids=(7,)), ("length", "")),
        (6, 0, SamplingParams(max_new_tokens=3), ("", "")),
        # vLLM: the generation config's other end-of-sequence ids are stop token ids, named as the stop reason
        (EOT, 0, SamplingParams(max_new_tokens=3), ("stop_token", "3")),
        (EOT, 2, SamplingParams(max_new_tokens=3), ("stop_token", "3")),
        (EOT, 1, SamplingParams(max_new_tokens=3, ignore_eos=True), ("", "")),  # ignored as the tokenizer's is
    ],
)
def test_the_end_of_a_choice_in_vllms_order(token: int, index: int, params: SamplingParams,
                                            expected: tuple[str, str]) -> None:  # fmt: skip
    stream = TokenStream(FACTS, _decode, "split")
    assert stream.finish(Chosen(token), index, None, params) == expected


def test_a_stop_string_the_last_allowed_token_completes_is_a_stop() -> None:
    stream = TokenStream(FACTS, _decode, "split")
    params = SamplingParams(max_new_tokens=2, stop=("b",))
    stops = TextStops(_decode, params.stop)
    assert stream.finish(Chosen(5), 0, stops, params) == ("", "")
    assert stream.finish(Chosen(6), 1, stops, params) == ("stop", "b")
