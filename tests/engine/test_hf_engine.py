"""The HF backend on tiny-llama: exact split/colocated equality and typed bad-input errors."""

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from prfaas.engine.base import ModelFacts
from prfaas.engine.errors import (
    InvalidPrompt,
    KVDtypeMismatch,
    KVShapeMismatch,
    ModelMismatch,
    PromptTooLong,
)
from prfaas.engine.hf import HFEngine
from prfaas.engine.kv import KVCache
from prfaas.engine.sampling import SamplingParams
from prfaas.engine.serialize import kv_from_bytes, kv_to_bytes

GREEDY = SamplingParams(max_new_tokens=32, ignore_eos=True)


def prompt(engine: HFEngine, text: str, n: int) -> list[int]:
    ids = engine.encode(text)
    assert len(ids) >= n
    return ids[:n]


def test_tiny_model_output_is_varied(tiny_engine: HFEngine, long_text: str) -> None:
    # A collapsed random model (one token repeated) would make every equality test vacuous.
    tokens = tiny_engine.generate(prompt(tiny_engine, long_text, 64), GREEDY)
    assert len(tokens) == 32
    assert len(set(tokens)) >= 12


def test_kv_shape_and_identity(tiny_engine: HFEngine, long_text: str) -> None:
    ids = prompt(tiny_engine, long_text, 40)
    kv = tiny_engine.prefill(ids, GREEDY).kv
    assert kv.num_layers == 4
    assert kv.num_tokens == 40
    assert tuple(kv.layers[0].k.shape) == (2, 40, 16)  # [kv_heads, tokens, head_dim]
    assert kv.model_fingerprint == tiny_engine.fingerprint
    assert kv.bytes_per_token == tiny_engine.kv_bytes_per_token == 2 * 4 * 2 * 16 * 4


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(max_new_tokens=32, temperature=0.9, top_p=0.95, seed=11)])
def test_decode_from_serialized_kv_equals_generate(
    tiny_engine: HFEngine, long_text: str, params: SamplingParams
) -> None:
    ids = prompt(tiny_engine, long_text, 100)
    colocated = tiny_engine.generate(ids, params)
    pre = tiny_engine.prefill(ids, params)
    kv = kv_from_bytes(kv_to_bytes(pre.kv))
    assert [pre.first_token, *tiny_engine.decode(kv, pre.first_token, params)] == colocated


def test_greedy_matches_transformers_generate(tiny_engine: HFEngine, long_text: str) -> None:
    ids = prompt(tiny_engine, long_text, 100)
    reference = tiny_engine.model.generate(
        torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long), max_new_tokens=32,
        do_sample=False, eos_token_id=None,
    )  # fmt: skip
    assert tiny_engine.generate(ids, GREEDY) == reference[0, len(ids) :].tolist()


def test_decode_stops_at_eos_unless_told_not_to(tiny_engine: HFEngine, long_text: str) -> None:
    ids = prompt(tiny_engine, long_text, 30)
    eos = next(iter(tiny_engine.eos_token_ids))
    pre = tiny_engine.prefill(ids, GREEDY)
    assert list(tiny_engine.decode(pre.kv, eos, SamplingParams(max_new_tokens=8))) == []
    assert len(list(tiny_engine.decode(pre.kv, eos, SamplingParams(max_new_tokens=8, ignore_eos=True)))) == 7


def test_the_tokenizers_eos_ends_generation_as_in_vllm(tiny_engine: HFEngine, tmp_path: Path) -> None:
    """vLLM stops on the tokenizer's eos_token_id (here <|im_end|>, 2) besides the generation config's
    (here changed to 0); both engines' facts name both, and the decode region reads them there."""
    variant = tmp_path / "tiny-eos"
    variant.mkdir()
    for f in tiny_engine.path.iterdir():
        if f.is_file():
            (variant / f.name).write_bytes(f.read_bytes())
    for name in ("config.json", "generation_config.json"):
        config = json.loads((variant / name).read_text())
        (variant / name).write_text(json.dumps(config | {"eos_token_id": 0}))
    engine = HFEngine(variant)
    assert engine.tokenizer.eos_token_id == 2
    facts = ModelFacts.read(variant, "float32")
    assert engine.eos_token_ids == facts.eos_token_ids == {0, 2}
    assert engine.facts.eos_token_id == facts.eos_token_id == 2  # the tokenizer's: no stop reason (0's is "0")
    ids = engine.encode("prefill decode", chat=True)
    assert engine.generate(ids, SamplingParams(max_new_tokens=5, logit_bias=((2, 100.0),))) == [2]


def test_kv_from_another_model_is_refused(tiny_engine: HFEngine, long_text: str, tmp_path: Path) -> None:
    # Same architecture, one weight nudged: only the fingerprint tells them apart.
    other = tmp_path / "tiny-variant"
    other.mkdir()
    for f in tiny_engine.path.iterdir():
        if f.is_file():
            (other / f.name).write_bytes(f.read_bytes())
    weights = load_file(other / "model.safetensors")
    weights["model.norm.weight"] = weights["model.norm.weight"] + 1e-3
    save_file(weights, other / "model.safetensors", metadata={"format": "pt"})
    variant = HFEngine(other)
    assert variant.fingerprint != tiny_engine.fingerprint

    kv = tiny_engine.prefill(prompt(tiny_engine, long_text, 20), GREEDY).kv
    with pytest.raises(ModelMismatch, match="produced by model"):
        list(variant.decode(kv, 5, GREEDY))


def test_kv_in_another_dtype_is_refused(tiny_engine: HFEngine, long_text: str) -> None:
    bf16 = HFEngine("tiny-llama", dtype="bfloat16")
    kv = kv_from_bytes(kv_to_bytes(bf16.prefill(prompt(bf16, long_text, 20), GREEDY).kv))
    assert kv.dtype == "bfloat16"
    with pytest.raises(KVDtypeMismatch, match="KV cache dtype bfloat16 does not match engine dtype float32"):
        tiny_engine.decode(kv, 5, GREEDY)


def test_kv_with_missing_layers_is_refused(tiny_engine: HFEngine, long_text: str) -> None:
    kv = tiny_engine.prefill(prompt(tiny_engine, long_text, 20), GREEDY).kv
    short = KVCache(kv.model_fingerprint, kv.dtype, kv.layers[:3], kv.num_tokens, kv.token_ids_hash)
    with pytest.raises(KVShapeMismatch, match="3 layers, expected 4"):
        tiny_engine.decode(short, 5, GREEDY)


def test_prompt_longer_than_context_is_refused(tiny_engine: HFEngine) -> None:
    assert tiny_engine.max_context == 4096
    with pytest.raises(PromptTooLong, match="prompt of 4097 tokens plus max_new_tokens 32 exceeds the model's context"):
        tiny_engine.prefill([7] * 4097, GREEDY)
    with pytest.raises(PromptTooLong, match="prompt of 4080 tokens"):  # fits alone, not with the output
        tiny_engine.prefill([7] * 4080, GREEDY)


@pytest.mark.parametrize(
    ("ids", "message"),
    [([], "prompt is empty"), ([1, 999_999], "token id 999999 is outside the vocabulary"), ([-1], "token id -1")],
)
def test_bad_token_ids_are_refused(tiny_engine: HFEngine, ids: list[int], message: str) -> None:
    with pytest.raises(InvalidPrompt, match=message):
        tiny_engine.prefill(ids, GREEDY)


def test_on_layer_hands_out_each_layers_kv_before_that_layer_computes_on(tiny_engine: HFEngine, long_text: str) -> None:
    # The prefill region ships layer i while layer i's attention and MLP still run, so the
    # last layer's bytes overlap compute too: on_layer(i) must come before layer i's MLP.
    events: list[tuple[str, int]] = []
    handles = [
        layer.mlp.register_forward_hook(lambda *_args, i=i: events.append(("mlp", i)))
        for i, layer in enumerate(tiny_engine.model.model.layers)
    ]
    tapped: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def on_layer(index: int, k: torch.Tensor, v: torch.Tensor) -> None:
        events.append(("kv", index))
        tapped[index] = (k, v)

    try:
        ids = prompt(tiny_engine, long_text, 40)
        result = tiny_engine.prefill(ids, GREEDY, on_layer=on_layer)
    finally:
        for handle in handles:
            handle.remove()
    num_layers = tiny_engine.num_layers
    assert events == [(kind, i) for i in range(num_layers) for kind in ("kv", "mlp")]
    for index, layer in enumerate(result.kv.layers):  # the result's own KV, never written after
        k, v = tapped[index]
        assert k.data_ptr() == layer.k.data_ptr() and v.data_ptr() == layer.v.data_ptr()
        assert k.shape == (tiny_engine.num_kv_heads, 40, tiny_engine.head_dim)
    assert result.first_token == tiny_engine.prefill(ids, GREEDY).first_token


def test_an_exception_from_on_layer_aborts_the_forward(tiny_engine: HFEngine, long_text: str) -> None:
    seen: list[int] = []

    def on_layer(index: int, k: torch.Tensor, v: torch.Tensor) -> None:
        seen.append(index)
        if index == 1:
            raise RuntimeError("canceled")  # the prefill region raises its own stop signal

    with pytest.raises(RuntimeError, match="canceled"):
        tiny_engine.prefill(prompt(tiny_engine, long_text, 10), GREEDY, on_layer=on_layer)
    assert seen == [0, 1]


def test_each_forward_runs_pinned_to_the_engines_cpus(tiny_engine: HFEngine, long_text: str) -> None:
    # engine_cpus (region config): the forward's thread on those CPUs, put back after each pass.
    before = os.sched_getaffinity(0)
    target = frozenset({max(before)})
    seen: list[set[int]] = []
    tiny_engine.cpus = target
    try:
        result = tiny_engine.prefill(
            prompt(tiny_engine, long_text, 12), GREEDY, on_layer=lambda *_: seen.append(os.sched_getaffinity(0))
        )
        assert list(tiny_engine.decode(result.kv, result.first_token, SamplingParams(max_new_tokens=3)))
    finally:
        tiny_engine.cpus = None
    assert seen and all(cpus == target for cpus in seen)
    assert os.sched_getaffinity(0) == before
