"""SplitRunner (engine/split.py) on tiny-llama: prefill in one worker process, decode in another, with
what the regions handle too: a repetition penalty (the decode needs the prompt's ids) and n choices
from one prefill."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from prfaas.engine.hf import HFEngine
from prfaas.engine.sampling import SamplingParams
from prfaas.engine.split import SplitRunner


@pytest.fixture(scope="module")
def runner(tiny_engine: HFEngine) -> Iterator[SplitRunner]:
    with SplitRunner("tiny-llama", timeout_s=120) as split:
        yield split


def test_a_repetition_penalty_splits_like_colocated(tiny_engine: HFEngine, runner: SplitRunner) -> None:
    """The decode worker gets the prompt's ids: without them the penalty cannot cover the prompt (InvalidPrompt)."""
    ids = tiny_engine.encode("prefill decode", chat=True)
    params = SamplingParams(max_new_tokens=6, repetition_penalty=1.3, ignore_eos=True)
    assert runner.run(ids, params).tokens == tiny_engine.generate(ids, params)


def test_each_of_n_choices_decodes_from_the_one_prefill(tiny_engine: HFEngine, runner: SplitRunner) -> None:
    ids = tiny_engine.encode("prefill decode", chat=True)
    params = SamplingParams(max_new_tokens=6, temperature=1.0, seed=7, n=3, ignore_eos=True)
    pre = tiny_engine.prefill(ids, params)
    # as a decode region does it: choice c from its own first token, with params.for_choice(c)
    expected = [[f.token, *tiny_engine.decode(pre.kv, f.token, params.for_choice(c), ids)]
                for c, f in enumerate(pre.choices)]  # fmt: skip
    split = runner.run(ids, params)
    assert list(split.choices) == expected and split.tokens == expected[0]
    assert len({tuple(tokens) for tokens in expected}) > 1  # the choices really differ
