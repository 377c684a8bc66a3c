"""How an OpenAI request becomes the job's sampling specification (api/sampling.py), as vLLM's server
maps it; refusals raise the API's 400 naming the parameter."""

from __future__ import annotations

import pytest

from prfaas.control_plane.api.errors import ApiError
from prfaas.control_plane.api.openai_schemas import ChatCompletionCreate, CompletionCreate
from prfaas.control_plane.api.sampling import sampling_spec

VOCAB = 1000


def test_completion_fields_map_as_vllm_maps_them() -> None:
    body = CompletionCreate(model="m", prompt="x", temperature=0.5, top_k=-1, stop="##", logprobs=3, echo=True,
                            logit_bias={"7": -100}, min_tokens=2, stop_token_ids=[5], n=2, seed=9)  # fmt: skip
    params = sampling_spec(body, 8, VOCAB)
    assert (params.temperature, params.top_k, params.stop, params.logprobs) == (0.5, 0, ("##",), 3)
    assert (params.prompt_logprobs, params.logit_bias, params.min_tokens, params.n) == (3, ((7, -100.0),), 2, 2)
    assert (params.stop_token_ids, params.seed, params.max_new_tokens) == ((5,), 9, 8)


def test_defaults_greedy_or_the_operators_temperature_with_a_seed() -> None:
    body = CompletionCreate(model="m", prompt="x")
    assert sampling_spec(body, 4, VOCAB).greedy and sampling_spec(body, 4, VOCAB).seed is None
    hot = sampling_spec(body, 4, VOCAB, default_temperature=1.0)
    assert hot.temperature == 1.0 and hot.seed is not None  # assigned, so a retry or split draws the same


def test_a_temperature_below_0_01_samples_and_takes_n_choices_as_vllm() -> None:
    """vLLM raises 0 < T < 0.01 to 0.01 and samples, so n > 1 is no greedy mistake there."""
    body = CompletionCreate(model="m", prompt="x", temperature=1e-9, seed=0, n=2)
    params = sampling_spec(body, 3, VOCAB)
    assert (params.temperature, params.greedy, params.n, params.seed) == (0.01, False, 2, 0)


def test_logit_bias_keys_naming_one_token_keep_the_last_as_vllm() -> None:
    """vLLM reads {int(key): bias}: of "300" and "0300", the later key in the request wins."""
    for bias, expected in (({"300": -100, "0300": 100}, 100.0), ({"0300": 100, "300": -100}, -100.0)):
        params = sampling_spec(CompletionCreate(model="m", prompt="x", logit_bias=bias), 3, VOCAB)
        assert params.logit_bias == ((300, expected),)
    spread = sampling_spec(CompletionCreate(model="m", prompt="x", logit_bias={"9": 1, "2": -1}), 3, VOCAB)
    assert spread.logit_bias == ((2, -1.0), (9, 1.0))  # one order, whatever the request's


def test_chat_logprobs_are_a_flag_and_a_count() -> None:
    messages = [{"role": "user", "content": "hi"}]
    assert sampling_spec(ChatCompletionCreate(model="m", messages=messages, logprobs=True), 4, VOCAB).logprobs == 0
    asked = ChatCompletionCreate(model="m", messages=messages, logprobs=True, top_logprobs=5)
    assert sampling_spec(asked, 4, VOCAB).logprobs == 5
    assert sampling_spec(ChatCompletionCreate(model="m", messages=messages), 4, VOCAB).logprobs is None
    with pytest.raises(ApiError) as info:
        sampling_spec(ChatCompletionCreate(model="m", messages=messages, top_logprobs=2), 4, VOCAB)
    assert info.value.param == "top_logprobs"


@pytest.mark.parametrize(
    ("fields", "param"),
    [({"n": 2}, "n"), ({"logit_bias": {"1000": 1}}, "logit_bias"), ({"stop_token_ids": [1000]}, "stop_token_ids"),
     ({"min_tokens": 9}, "min_tokens")],
)  # fmt: skip
def test_refusals_name_the_parameter(fields: dict[str, object], param: str) -> None:
    with pytest.raises(ApiError) as info:  # n > 1 under greedy decoding: refused, as vLLM does
        sampling_spec(CompletionCreate(model="m", prompt="x", **fields), 8, VOCAB)  # type: ignore[arg-type]
    assert (info.value.status_code, info.value.param) == (400, param)


def test_seeds_in_vllms_int64_range_and_top_logprobs_0_alone_as_vllm() -> None:
    """vLLM takes a seed in int64 (-1: none) and `top_logprobs: 0` without `logprobs`; both were 400 here."""
    messages = [{"role": "user", "content": "hi"}]
    unseeded = sampling_spec(CompletionCreate(model="m", prompt="x", seed=-1, temperature=1.0), 3, VOCAB)
    assert unseeded.seed is not None and unseeded.seed >= 0  # none asked: one assigned, as for no seed at all
    negative = sampling_spec(CompletionCreate(model="m", prompt="x", seed=-5, temperature=1.0), 3, VOCAB)
    assert negative.seed == 2**63 - 5  # the same seed each time (the wire's seed is unsigned)
    assert sampling_spec(CompletionCreate(model="m", prompt="x", seed=-(2**63)), 3, VOCAB).seed == 0
    assert sampling_spec(ChatCompletionCreate(model="m", messages=messages, top_logprobs=0), 4, VOCAB).logprobs is None
