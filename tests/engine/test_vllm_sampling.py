"""The job's sampling specification as the requests of a vLLM region (engine/vllm/sampling.py),
and vLLM's logprobs back as prfaas's. No vLLM here: the mapping is plain data; the
tests under tests/vllm run it through real vLLM servers."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from prfaas.engine.errors import InvalidSamplingParams
from prfaas.engine.sampling import Chosen, SamplingParams, TokenLogprobs
from prfaas.engine.vllm.sampling import (
    FIRST_OUTPUT_KEY,
    chosen,
    decode_seed,
    vllm_sampling,
    wire_logprobs,
    wire_prompt_logprobs,
)

PARAMS = SamplingParams(max_new_tokens=10, temperature=0.8, top_p=0.9, top_k=20, min_p=0.05, seed=11,
                        repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.25, min_tokens=4,
                        stop=("\n",), stop_token_ids=(7,), logit_bias=((3, -2.0),), logprobs=2,
                        prompt_logprobs=1)  # fmt: skip


def test_a_split_asks_step_0_of_the_prefill_and_the_rest_of_the_decode() -> None:
    prefill = vllm_sampling(PARAMS, "prefill")
    decode = vllm_sampling(PARAMS, "decode", first_token=42)
    whole = vllm_sampling(PARAMS, "generate")

    assert (prefill["max_tokens"], decode["max_tokens"], whole["max_tokens"]) == (1, 9, 10)
    assert (prefill["min_tokens"], decode["min_tokens"], whole["min_tokens"]) == (1, 3, 4)
    assert prefill["seed"] == whole["seed"] == 11 and decode["seed"] == decode_seed(11) != 11
    assert prefill["prompt_logprobs"] == whole["prompt_logprobs"] == 1 and "prompt_logprobs" not in decode
    assert decode["extra_args"] == {FIRST_OUTPUT_KEY: 42} and "extra_args" not in prefill
    for kwargs in (prefill, decode, whole):  # the same everywhere
        assert kwargs["logit_bias"] == {3: -2.0} and kwargs["stop_token_ids"] == [7] and kwargs["logprobs"] == 2
        assert (kwargs["top_p"], kwargs["top_k"], kwargs["min_p"], kwargs["repetition_penalty"]) == (0.9, 20, 0.05, 1.1)
        assert "stop" not in kwargs  # stop strings are the decode agent's


def test_greedy_has_no_seed_and_no_penalty_needs_no_correction() -> None:
    greedy = SamplingParams(max_new_tokens=4, seed=5, repetition_penalty=1.3)
    decode = vllm_sampling(greedy, "decode", first_token=1)
    assert decode["seed"] is None and "extra_args" not in decode  # repetition covers the prompt already
    assert vllm_sampling(SamplingParams(max_new_tokens=4, min_tokens=0), "prefill")["min_tokens"] == 0


def test_a_temperature_below_0_01_is_sent_raised_and_seeded() -> None:
    """vLLM would raise 1e-6 to 0.01 itself and sample; without the job's seed it would draw unseeded."""
    params = SamplingParams(temperature=1e-6, seed=5)
    prefill, whole = vllm_sampling(params, "prefill"), vllm_sampling(params, "generate")
    decode = vllm_sampling(params, "decode", first_token=1)
    assert (prefill["temperature"], prefill["seed"]) == (whole["temperature"], whole["seed"]) == (0.01, 5)
    assert (decode["temperature"], decode["seed"]) == (0.01, decode_seed(5))


def test_n_above_one_and_a_decode_without_its_first_token_are_refused() -> None:
    with pytest.raises(InvalidSamplingParams, match="n=2"):
        vllm_sampling(SamplingParams(temperature=1.0, seed=1, n=2), "generate")
    with pytest.raises(ValueError, match="first token"):
        vllm_sampling(PARAMS, "decode")


def test_a_temperature_past_vllms_bound_is_an_invalid_argument_not_an_engine_error() -> None:
    assert vllm_sampling(SamplingParams(temperature=2.0, seed=1), "generate")["temperature"] == 2.0
    with pytest.raises(InvalidSamplingParams, match=r"temperature must be in \[0, 2\], got 2.5"):
        vllm_sampling(SamplingParams(temperature=2.5, seed=1), "generate")


@dataclass
class Logprob:  # the two fields of vllm.logprobs.Logprob that are read
    logprob: float
    rank: int | None


def test_vllm_logprobs_become_prfaas_tokens_best_first() -> None:
    # vLLM gives the top k and the chosen token (here ranked 4th, so k + 1 entries), unordered
    entries = {9: Logprob(-0.5, 2), 4: Logprob(-0.1, 1), 30: Logprob(-3.0, 4)}
    prompt = [{5: Logprob(-1.0, 1)}, {6: Logprob(-2.0, 3), 5: Logprob(-0.2, 1)}]
    step = (30, None, None)
    wire = wire_logprobs(entries, 30, 2)
    prompt_wire = wire_prompt_logprobs([None, *prompt], [1, 5, 6], 1)

    assert chosen(step) == Chosen(30)
    assert chosen((30, wire, prompt_wire)) == Chosen(
        30, TokenLogprobs(-3.0, 4, (4, 9), (-0.1, -0.5)),
        (TokenLogprobs(-1.0, 1, (5,), (-1.0,)), TokenLogprobs(-2.0, 3, (5,), (-0.2,))),
    )  # fmt: skip
