"""SmolLM2 (real trained weights, fp32): prefill in one OS process, KV bytes handed to a
second process, decode there. Tokens must equal transformers' own colocated `generate()`,
and the last step's logits must agree to 1e-4 (tokens alone miss small corruptions)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from prfaas.engine.errors import KVChecksumMismatch, KVTruncated, ModelMismatch, PromptTooLong
from prfaas.engine.hf import HFEngine
from prfaas.engine.models import prepare_model
from prfaas.engine.sampling import SamplingParams
from prfaas.engine.serialize import kv_to_bytes
from prfaas.engine.split import SplitRunner

pytestmark = pytest.mark.e2e
MODEL = "smollm2-135m"
GREEDY = SamplingParams(max_new_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def smollm2() -> HFEngine:
    prepare_model(MODEL)
    return HFEngine(MODEL)


@pytest.fixture(scope="module")
def runner(smollm2: HFEngine) -> Iterator[SplitRunner]:
    with SplitRunner(MODEL, timeout_s=600) as split:
        split.warm_up()
        yield split


@pytest.mark.parametrize("num_tokens", [16, 512, 2048])
def test_split_across_processes_equals_colocated_generate(
    smollm2: HFEngine, runner: SplitRunner, long_text: str, num_tokens: int
) -> None:
    ids = smollm2.encode(long_text)[:num_tokens]
    assert len(ids) == num_tokens

    split = runner.run(ids, GREEDY)

    assert len({split.prefill_pid, split.decode_pid, os.getpid()}) == 3
    reference = smollm2.model.generate(
        torch.tensor([ids]), attention_mask=torch.ones(1, num_tokens, dtype=torch.long), max_new_tokens=32,
        do_sample=False, eos_token_id=None, output_logits=True, return_dict_in_generate=True,
    )  # fmt: skip
    assert split.tokens == reference.sequences[0, num_tokens:].tolist()
    np.testing.assert_allclose(split.last_logits, reference.logits[-1][0].float().numpy(), rtol=0, atol=1e-4)
    assert split.kv_bytes > num_tokens * smollm2.kv_bytes_per_token  # fp32 K and V plus a header


def test_seeded_sampling_split_equals_colocated(smollm2: HFEngine, runner: SplitRunner, long_text: str) -> None:
    ids = smollm2.encode(long_text)[:512]
    params = SamplingParams(max_new_tokens=32, temperature=0.8, top_p=0.95, seed=1234, ignore_eos=True)
    split = runner.run(ids, params)
    assert split.tokens == smollm2.generate(ids, params)
    assert split.tokens != runner.run(ids, GREEDY).tokens  # it really sampled


def test_corrupt_kv_is_refused_by_the_decode_process(smollm2: HFEngine, runner: SplitRunner, long_text: str) -> None:
    pre = runner.prefill(smollm2.encode(long_text)[:16], GREEDY)
    with pytest.raises(KVTruncated):
        runner.decode(pre.kv_bytes[:-1], pre.first_token, GREEDY)
    flipped = bytearray(pre.kv_bytes)
    flipped[len(flipped) // 2] ^= 0x10
    with pytest.raises(KVChecksumMismatch):
        runner.decode(bytes(flipped), pre.first_token, GREEDY)


def test_kv_of_another_model_is_refused_by_the_decode_process(
    tiny_engine: HFEngine, runner: SplitRunner, long_text: str
) -> None:
    kv = tiny_engine.prefill(tiny_engine.encode(long_text)[:16], GREEDY).kv
    with pytest.raises(ModelMismatch):
        runner.decode(kv_to_bytes(kv), 5, GREEDY)


def test_prompt_longer_than_context_is_refused_by_the_prefill_process(runner: SplitRunner) -> None:
    with pytest.raises(PromptTooLong, match="exceeds the model's context of 8192 tokens"):
        runner.prefill([42] * 8193, GREEDY)
