import json

import pytest
import torch

from prfaas.engine.errors import InvalidSamplingParams
from prfaas.engine.sampling import History, SamplingParams, choose, process, sample_next, token_logprobs


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_new_tokens": 0}, "max_new_tokens must be >= 1"),
        ({"temperature": -0.5, "seed": 1}, "temperature must be >= 0"),
        ({"temperature": float("nan"), "seed": 1}, "temperature must be >= 0"),
        ({"temperature": float("inf"), "seed": 1}, "temperature must be >= 0 and finite"),  # -inf/inf: NaN probs
        ({"top_p": 0.0}, "top_p must be in (0, 1]"),
        ({"top_p": 1.5}, "top_p must be in (0, 1]"),
        ({"temperature": 0.7}, "seed is required"),  # sampling without a seed could not be split
    ],
)
def test_out_of_range_params_are_rejected(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(InvalidSamplingParams, match=message.replace("(", r"\(").replace("]", r"\]")):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_greedy_picks_the_first_maximum() -> None:
    logits = torch.tensor([0.1, 3.0, 3.0, -1.0])
    assert sample_next(logits, SamplingParams(), step=0) == 1  # ties go to the lowest id


def test_sampling_depends_only_on_seed_and_step() -> None:
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(3))
    params = SamplingParams(temperature=1.0, seed=42)
    first = [sample_next(logits, params, step) for step in range(50)]
    # Interleaving other draws (another request, another process) changes nothing.
    torch.rand(100)
    again = [sample_next(logits, params, step) for step in reversed(range(50))][::-1]
    assert first == again
    assert len(set(first)) > 10  # and it really samples: 50 draws over 1000 near-flat tokens


def test_other_seed_gives_other_tokens() -> None:
    logits = torch.zeros(1000)
    a = [sample_next(logits, SamplingParams(temperature=1.0, seed=1), s) for s in range(20)]
    b = [sample_next(logits, SamplingParams(temperature=1.0, seed=2), s) for s in range(20)]
    assert a != b


def test_top_p_keeps_only_the_nucleus() -> None:
    # probabilities ~ [0.6, 0.3, 0.1 spread over the rest]: top_p=0.8 keeps ids 0 and 1 only.
    probs = torch.tensor([0.6, 0.3] + [0.1 / 8] * 8)
    logits = probs.log()
    params = SamplingParams(temperature=1.0, top_p=0.8, seed=5)
    picks = {sample_next(logits, params, step) for step in range(200)}
    assert picks == {0, 1}


def test_tiny_top_p_is_greedy() -> None:
    logits = torch.tensor([1.0, 5.0, 2.0])
    params = SamplingParams(temperature=1.0, top_p=1e-6, seed=9)
    assert {sample_next(logits, params, s) for s in range(20)} == {1}


@pytest.mark.parametrize("temperature", [5e-324, 1e-310, 9e-6, 5e-3])
def test_a_temperature_below_0_01_is_raised_to_it_and_samples(temperature: float) -> None:
    """vLLM's SamplingParams raises 0 < T < 0.01 to 0.01 before its greedy check, so only 0 is greedy:
    two tied logits both come up, and n > 1 is accepted. (Dividing by 1e-310 would overflow to NaN.)"""
    logits = torch.tensor([1.0, 5.0, 5.0, 2.0])
    params = SamplingParams(temperature=temperature, seed=3, n=2)
    assert params.temperature == 0.01 and not params.greedy
    assert {sample_next(logits, params.for_choice(0), s) for s in range(20)} == {1, 2}
    assert SamplingParams.from_dict(params.to_dict()) == params
    assert SamplingParams(temperature=0.0).greedy and SamplingParams(temperature=0.01, seed=3).temperature == 0.01


# -- the rest of the specification, in vLLM's order ---------------------------------------------

EOS = frozenset({0})


def test_penalties_follow_vllms_formulas() -> None:
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0])
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    out = process(logits, params, History(prompt=[1], output=[2, 2, 4]), EOS)
    # repetition over prompt and output (positive / 2, negative x 2), then 0.5 x count and 0.25 if in the output
    expected = torch.tensor([2.0, -2.0, 0.25 - 0.5 * 2 - 0.25, 3.0, -4.0 - 0.5 - 0.25])
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("penalty", [1e-40, 1e-300])
def test_a_tiny_repetition_penalty_samples_instead_of_failing(penalty: float) -> None:
    """A positive logit over a tiny penalty overflows float32; the softmax of inf is NaN and multinomial raised
    (INTERNAL in the region). The overflow is capped: the repeated token is the one drawn."""
    logits = torch.tensor([2.0, 1.0, 3.0, 0.5])
    params = SamplingParams(temperature=1.0, seed=7, repetition_penalty=penalty)
    for step in range(4):
        assert choose(logits, params, step, History(prompt=[0], output=[])).token == 0


def test_penalties_change_the_greedy_choice() -> None:
    logits = torch.tensor([0.0, 3.0, 2.9])
    assert choose(logits, SamplingParams(), 1, History(output=[1])).token == 1
    assert choose(logits, SamplingParams(presence_penalty=0.5), 1, History(output=[1])).token == 2


def test_min_tokens_bans_eos_and_stop_token_ids_until_reached() -> None:
    logits = torch.tensor([9.0, 8.0, 1.0, 0.0])
    params = SamplingParams(max_new_tokens=8, min_tokens=2, stop_token_ids=(1,))
    assert choose(logits, params, 0, History(output=[]), EOS).token == 2
    assert choose(logits, params, 1, History(output=[2]), EOS).token == 2
    assert choose(logits, params, 2, History(output=[2, 2]), EOS).token == 0  # reached: EOS may come


def test_min_tokens_bans_eos_even_when_eos_is_ignored() -> None:
    """vLLM bans every stop id, EOS included, until min_tokens, whatever ignore_eos says; ignore_eos only
    keeps an EOS chosen later from ending the generation (hf.ends)."""
    logits = torch.tensor([9.0, 8.0, 1.0, 0.0])
    ignoring = SamplingParams(max_new_tokens=8, min_tokens=2, ignore_eos=True)
    assert choose(logits, ignoring, 0, History(), EOS).token == 1
    assert choose(logits, ignoring, 2, History(output=[1, 1]), EOS).token == 0  # reached: EOS may come


def test_logit_bias_is_added_before_the_choice() -> None:
    logits = torch.tensor([1.0, 2.0, 3.0])
    assert choose(logits, SamplingParams(logit_bias=((2, -100.0),)), 0).token == 1
    assert choose(logits, SamplingParams(logit_bias=((0, 5.0),)), 0).token == 0


def test_top_k_and_min_p_keep_only_the_likely_tokens() -> None:
    logits = torch.tensor([5.0, 4.0, 3.0, 0.0, -1.0])
    top2 = SamplingParams(temperature=1.0, top_k=2, seed=3)
    assert {choose(logits, top2, s).token for s in range(200)} == {0, 1}
    # min_p 0.3: p(2) = e^-2 p(0) ~ 0.135 p(0) is dropped, p(1) ~ 0.37 p(0) kept
    min_p = SamplingParams(temperature=1.0, min_p=0.3, seed=3)
    assert {choose(logits, min_p, s).token for s in range(200)} == {0, 1}


def test_logprobs_are_of_the_raw_logits_with_rank_and_top_k() -> None:
    logits = torch.tensor([1.0, 3.0, 2.0, 0.0])
    raw = torch.log_softmax(logits, dim=-1)
    # the penalty moves the choice, not the logprobs (vLLM's raw_logprobs)
    chosen = choose(logits, SamplingParams(logprobs=2, logit_bias=((2, 5.0),)), 0)
    assert chosen.token == 2 and chosen.logprobs is not None
    assert chosen.logprobs.logprob == pytest.approx(float(raw[2])) and chosen.logprobs.rank == 2
    assert chosen.logprobs.top_ids == (1, 2)
    assert chosen.logprobs.top_logprobs == pytest.approx([float(raw[1]), float(raw[2])])
    assert choose(logits, SamplingParams(), 0).logprobs is None


def test_a_tied_token_ranks_after_its_equals_as_vllm_counts() -> None:
    """vLLM's rank is the number of tokens at least as likely, itself included: of two tied most likely
    tokens, the one chosen (the lower id, under greedy) ranks 2, not 1."""
    logits = torch.tensor([0.0, 3.0, 3.0, 1.0])
    chosen = choose(logits, SamplingParams(logprobs=0), 0)
    assert chosen.token == 1 and chosen.logprobs is not None and chosen.logprobs.rank == 2
    assert token_logprobs(logits, 3, 0).rank == 3 and token_logprobs(logits, 0, 0).rank == 4  # no tie: as before


def test_vocab_checks_name_the_field() -> None:
    with pytest.raises(InvalidSamplingParams, match="stop_token_ids: token id 9"):
        SamplingParams(stop_token_ids=(9,)).check_vocab(5)
    with pytest.raises(InvalidSamplingParams, match="logit_bias: token id 7"):
        SamplingParams(logit_bias=((7, 1.0),)).check_vocab(5)


def test_the_specification_survives_a_job_record() -> None:
    params = SamplingParams(max_new_tokens=9, temperature=0.7, top_k=5, seed=3, stop=("a", "bc"),
                            stop_token_ids=(4,), logit_bias=((2, -1.5),), logprobs=3, min_tokens=2)  # fmt: skip
    assert SamplingParams.from_dict(json.loads(json.dumps(params.to_dict()))) == params


def test_each_choice_draws_from_a_seed_of_its_own() -> None:
    params = SamplingParams(max_new_tokens=4, temperature=1.0, seed=5, n=3)
    seeds = [params.for_choice(c).seed for c in range(3)]
    assert seeds[0] == 5 and len(set(seeds)) == 3  # choice 0 is the request as asked
    assert all(params.for_choice(c).n == 1 for c in range(3))
    with pytest.raises(InvalidSamplingParams, match="n must be 1 when using greedy sampling"):
        SamplingParams(n=2)  # vLLM's rule
    logits = torch.zeros(1000)
    draws = [[choose(logits, params.for_choice(c), s).token for s in range(10)] for c in range(3)]
    assert draws[0] != draws[1] != draws[2]
    with pytest.raises(InvalidSamplingParams, match="n must be in"):
        SamplingParams(n=0)
