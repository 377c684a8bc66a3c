"""Quality of the lossy KV codecs on SmolLM2-135M: greedy token agreement and perplexity delta.

    .venv/bin/python -m prfaas.bench.codec_quality [--num-prompts 50] [--codecs fp8,int8] [--json PATH]

Prompts are 256-token slices of standard-library module sources (two per module, at a
third and two thirds of each), identical on every machine with the same Python. For each,
the exact KV of one prefill is compared with that KV after every layer's K and V went
through the codec (encode, decode), as a decode region would receive it:

- token agreement: 32 greedy tokens (the first chosen at prefill, so always equal, then 31
  decode steps); agreement is the share of the 31 decoded positions that match, and a
  prompt is identical when all 31 do. After a first mismatch the two continuations condition
  on different text, so later positions tend to differ too. The exact and lossy caches
  decode as rows of one batch (a CPU decode step costs reading the weights, whatever the
  rows); on the first prompt the exact row is checked against `engine.decode`.
- perplexity: the next 64 tokens of the same text, teacher-forced on top of the prompt KV;
  the 63 tokens predicted from positions that attend to the (lossy) cache are scored.
  Reported as exact and lossy perplexity, their relative delta, and the mean KL divergence
  KL(exact || lossy) of the next-token distributions.
- teacher-forced agreement: over those 63 positions, the share where the lossy cache's most
  likely next token is the exact cache's (no divergence carries over: a steadier measure).
- ratio on bf16: bf16 raw bytes of every layer's K and V / the codec's payload bytes, the KV
  rounded to bf16 and encoded as a bf16 sender would.

Besides the wire codecs, `kvq-K-V[-G]` names a point of the kv codecs' family: keys with codes up
to K (127: 8 bits) per channel (a scale per G tokens; none: one), values rotated with codes up to
V per token: what the ratio / agreement curve in docs/benchmarks.md was drawn from. `pre:CODEC` is a
kv codec with its keys quantized before RoPE; it, the bf16-round control and the ablations are in
bench/codec_variants.py.
The wire codecs kvw6 and kvw4 get the model's query energy (prfaas.engine.calibration) as a
calibrated prefill region ships them. `NAME+qw` is a kv codec with query-weighted key scales, and
`kvqw-K-L-V[-G]` a weighted point: codes up to K, the geometric mean of the key steps at amax / L.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
from transformers import DynamicCache

from prfaas.bench.codec_variants import ABLATIONS, Ablation, Bf16Rounding, PreRope, rope_of, tensor_bytes
from prfaas.engine.calibration import calibration_windows, load_query_energy, measure_query_energy
from prfaas.engine.hf import HFEngine
from prfaas.engine.kv import KVCache, LayerKV
from prfaas.engine.sampling import SamplingParams
from prfaas.transport.codecs import Codec, CodecId, KVQuantizedCodec, TensorMeta, get_codec
from prfaas.transport.kvquant import KV_QUANTIZERS, KVQuantizer

PROMPT_TOKENS = 256
CONTINUATION_TOKENS = 64
GENERATED_TOKENS = 32
MODULES = (
    "argparse", "textwrap", "json.decoder", "json.encoder", "collections", "enum", "dataclasses",
    "inspect", "typing", "functools", "pathlib", "logging", "subprocess", "email.message",
    "http.client", "string", "shutil", "tarfile", "zipfile", "fractions", "statistics", "csv",
    "difflib", "pprint", "configparser",
)  # fmt: skip


@dataclass
class Summary:
    codec: str
    num_prompts: int
    token_agreement: float  # share of decoded positions equal to the exact run's
    identical_prompts: int  # prompts whose every decoded token matches
    mean_first_divergence: float  # decoded tokens before the first mismatch (31 when none)
    ppl_exact: float
    ppl_lossy: float
    delta_ppl_pct: float  # 100 * (ppl_lossy / ppl_exact - 1)
    mean_kl: float  # nats per position, KL(exact || lossy)
    teacher_forced_agreement: float  # share of teacher-forced positions whose top-1 token is the exact one's
    ratio_bf16: float | None  # bf16 raw bytes / wire bytes (None: not a codec)


def text_windows(engine: HFEngine, num_prompts: int) -> list[tuple[str, list[int], list[int]]]:
    """(source, prompt ids, continuation ids), two windows per module, in module order."""
    windows = []
    for name in MODULES:
        ids = engine.encode(inspect.getsource(importlib.import_module(name)))
        for start in (len(ids) // 3, 2 * len(ids) // 3):
            end = start + PROMPT_TOKENS
            if end + CONTINUATION_TOKENS <= len(ids):
                windows.append((f"{name}@{start}", ids[start:end], ids[end : end + CONTINUATION_TOKENS]))
    if len(windows) < num_prompts:
        raise SystemExit(f"only {len(windows)} text windows available, asked for {num_prompts}")
    return windows[:num_prompts]


WEIGHTED: set[str] = set()  # codecs whose keys are encoded with the model's query energy
QUERY_ENERGY: list[np.ndarray] = []  # [num_layers, num_kv_heads, head_dim], once measured


def codec_named(name: str) -> Codec | Ablation:
    if name.startswith("pre:"):  # a kv codec with keys quantized before RoPE (bench/codec_variants.py)
        inner = codec_named(name.removeprefix("pre:"))
        if not isinstance(inner, KVQuantizedCodec):
            raise SystemExit(f"{name}: pre: goes with a kv codec (kv8, kvw6, kvq-..., kvqw-...)")
        if inner.name in WEIGHTED:
            WEIGHTED.add(name)
        return PreRope(inner)
    if name == Bf16Rounding.name:
        return Bf16Rounding()
    if name.endswith("+qw") or name.startswith("kvqw-"):
        WEIGHTED.add(name)
        if name.startswith("kvqw-"):  # kvqw-K-L-V[-G]
            k_qmax, level, v_qmax, *group = (int(p) for p in name.split("-")[1:])
            quantizer = KVQuantizer(name, k_qmax, v_qmax, group[0] if group else 0, level)
        else:
            quantizer = KV_QUANTIZERS[name.removesuffix("+qw")]
        return KVQuantizedCodec(CodecId.KV8, name, quantizer)
    if name.startswith("kvq-"):  # a point of the kv codecs' family: kvq-K-V[-G]
        k_qmax, v_qmax, *group = (int(p) for p in name.split("-")[1:])
        return KVQuantizedCodec(CodecId.KV8, name, KVQuantizer(name, k_qmax, v_qmax, group[0] if group else 0))
    if name in KV_QUANTIZERS and KV_QUANTIZERS[name].weighted:  # kvw6, kvw4: as a calibrated region ships them
        WEIGHTED.add(name)
    return ABLATIONS[name] if name in ABLATIONS else get_codec(name)


def ratio_bf16(kv: KVCache, codec: Codec | Ablation) -> float | None:
    """bf16 raw bytes of every K and V / the codec's payload bytes (None for controls and ablations)."""
    if isinstance(codec, (Ablation, Bf16Rounding)):
        return None
    raw = wire = 0
    for index, layer in enumerate(kv.layers):
        for part, t in enumerate((layer.k, layer.v)):
            meta = TensorMeta("bfloat16", tuple(t.shape), part, key_weights(codec, index, part))
            raw += meta.nbytes
            wire += len(codec.encode(tensor_bytes(t.to(torch.bfloat16)), meta))
    return raw / wire


def key_weights(codec: Codec | Ablation, layer: int, part: int) -> np.ndarray | None:
    return QUERY_ENERGY[0][layer] if part == 0 and codec.name in WEIGHTED else None


def roundtrip(kv: KVCache, codec: Codec | Ablation) -> KVCache:
    """`kv` after every layer's K and V went through `codec.encode` and `codec.decode`
    (or an ablation's quantizers)."""
    if isinstance(codec, Ablation):
        ablation = codec
        layers = tuple(
            LayerKV(k=ablation.k(layer.k.float()).to(layer.k.dtype), v=ablation.v(layer.v.float()).to(layer.v.dtype))
            for layer in kv.layers
        )
        return KVCache(kv.model_fingerprint, kv.dtype, layers, kv.num_tokens, kv.token_ids_hash)

    def through(t: torch.Tensor, index: int, part: int) -> torch.Tensor:
        meta = TensorMeta(kv.dtype, tuple(t.shape), part, key_weights(codec, index, part))
        decoded = codec.decode(codec.encode(tensor_bytes(t), meta), meta)
        return torch.frombuffer(bytearray(decoded), dtype=t.dtype).view(t.shape)

    layers = tuple(LayerKV(k=through(layer.k, i, 0), v=through(layer.v, i, 1)) for i, layer in enumerate(kv.layers))
    return KVCache(kv.model_fingerprint, kv.dtype, layers, kv.num_tokens, kv.token_ids_hash)


def stacked_cache(engine: HFEngine, kvs: list[KVCache]) -> Any:
    """A DynamicCache holding `kvs` as batch rows, as engine/hf.py builds one for a single cache."""
    cache: Any = DynamicCache(config=engine.model.config)
    for index in range(kvs[0].num_layers):
        keys = torch.stack([kv.layers[index].k for kv in kvs])  # [rows, kv_heads, tokens, head_dim]
        values = torch.stack([kv.layers[index].v for kv in kvs])
        cache.update(keys, values, index)
    return cache


@torch.inference_mode()
def greedy_tokens(engine: HFEngine, kvs: list[KVCache], first_token: int) -> list[list[int]]:
    """Per cache, the greedy tokens of generation steps 1 .. GENERATED_TOKENS - 1 after `first_token`,
    like `engine.decode` with greedy params and ignore_eos, but with every cache a batch row of one
    forward pass a step: a step reads all the weights, so extra rows cost little on a CPU."""
    cache = stacked_cache(engine, kvs)
    ids = torch.full((len(kvs), 1), first_token, dtype=torch.long)
    steps = []
    for _ in range(GENERATED_TOKENS - 1):
        logits = engine.model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
        ids = logits[:, -1].float().argmax(dim=-1, keepdim=True)
        steps.append(ids[:, 0].tolist())
    return [list(row) for row in zip(*steps, strict=True)]


@torch.inference_mode()
def continuation_logprobs(engine: HFEngine, kvs: list[KVCache], continuation: list[int]) -> torch.Tensor:
    """Log-probs [len(kvs), len(continuation) - 1, vocab] of each next token, teacher-forced
    after each cache of `kvs` (one batch row per cache, one forward pass for all)."""
    cache = stacked_cache(engine, kvs)
    ids = torch.tensor([continuation[:-1]] * len(kvs), dtype=torch.long)
    logits = engine.model(input_ids=ids, past_key_values=cache, use_cache=True).logits.float()
    return torch.log_softmax(logits, dim=-1)


def nll(logprobs: torch.Tensor, continuation: list[int]) -> float:
    """Summed negative log-likelihood of continuation[1:]."""
    targets = torch.tensor(continuation[1:], dtype=torch.long)
    return -float(logprobs.gather(1, targets.unsqueeze(1)).sum())  # logprobs: [positions, vocab]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=50, help="prompts to run, at most 50 (default 50)")
    parser.add_argument(
        "--codecs",
        default="fp8,int8",
        help=f"comma-separated codecs, bf16-round (a control) or ablations ({', '.join(ABLATIONS)}); default fp8,int8",
    )
    parser.add_argument("--dtype", default="float32", help="engine and KV dtype (default float32)")
    parser.add_argument("--json", metavar="PATH", help="also write the summary and per-prompt results as JSON")
    args = parser.parse_args(argv)
    codecs = [codec_named(name) for name in args.codecs.split(",")]

    started = time.perf_counter()
    engine = HFEngine("smollm2-135m", dtype=args.dtype)
    if WEIGHTED:
        facts = engine.facts
        stored = load_query_energy(facts.fingerprint, facts.num_layers, facts.num_kv_heads, facts.head_dim)
        QUERY_ENERGY.append(
            stored if stored is not None else measure_query_energy(engine.model, calibration_windows(engine.tokenizer))
        )
        print(f"query energy: {'stored' if stored is not None else 'measured now'}", flush=True)
    for codec in codecs:
        if isinstance(codec, PreRope):
            codec.rope = rope_of(engine.model, PROMPT_TOKENS)
    params = SamplingParams(max_new_tokens=GENERATED_TOKENS, ignore_eos=True)
    per_prompt: list[dict[str, Any]] = []
    totals: dict[str, dict[str, float]] = {
        c.name: {"match": 0, "identical": 0, "first_div": 0, "nll": 0, "kl": 0, "tf": 0, "ratio": 0} for c in codecs
    }
    exact_nll = 0.0
    batched_matches_engine = False
    windows = text_windows(engine, args.num_prompts)
    for number, (source, prompt, continuation) in enumerate(windows, 1):
        result = engine.prefill(prompt, params)
        kvs = [result.kv, *(roundtrip(result.kv, codec) for codec in codecs)]
        exact_tokens, *lossy_tokens = greedy_tokens(engine, kvs, result.first_token)
        if number == 1:  # the batched loop stands in for engine.decode: check it on one prompt
            batched_matches_engine = list(engine.decode(result.kv, result.first_token, params)) == exact_tokens
            print(f"batched greedy decoding == engine.decode on {source}: {batched_matches_engine}", flush=True)
        exact_logprobs, *lossy_logprobs = continuation_logprobs(engine, kvs, continuation)
        exact_top = exact_logprobs.argmax(dim=-1)
        exact_nll += nll(exact_logprobs, continuation)
        record: dict[str, Any] = {"source": source}
        for codec, tokens, logprobs in zip(codecs, lossy_tokens, lossy_logprobs, strict=True):
            matches = [a == b for a, b in zip(tokens, exact_tokens, strict=True)]
            first_div = matches.index(False) if False in matches else len(matches)
            kl = float((exact_logprobs.exp() * (exact_logprobs - logprobs)).sum(dim=-1).mean())
            t = totals[codec.name]
            t["match"] += sum(matches) / len(matches)
            t["identical"] += all(matches)
            t["first_div"] += first_div
            t["nll"] += nll(logprobs, continuation)
            t["kl"] += kl
            tf = float((logprobs.argmax(dim=-1) == exact_top).float().mean())
            t["tf"] += tf
            ratio = ratio_bf16(result.kv, codec)
            t["ratio"] += ratio or 0.0
            record[codec.name] = {"agreement": sum(matches) / len(matches), "first_divergence": first_div, "kl": kl,
                                  "teacher_forced_agreement": tf, "ratio_bf16": ratio}  # fmt: skip
        per_prompt.append(record)
        print(f"[{number}/{len(windows)}] {source}: {record}  ({time.perf_counter() - started:.0f} s)", flush=True)

    scored = len(windows) * (CONTINUATION_TOKENS - 1)
    ppl_exact = math.exp(exact_nll / scored)
    summaries = []
    for name, t in totals.items():
        ppl = math.exp(t["nll"] / scored)
        summaries.append(
            Summary(
                codec=name,
                num_prompts=len(windows),
                token_agreement=t["match"] / len(windows),
                identical_prompts=int(t["identical"]),
                mean_first_divergence=t["first_div"] / len(windows),
                ppl_exact=ppl_exact,
                ppl_lossy=ppl,
                delta_ppl_pct=100 * (ppl / ppl_exact - 1),
                mean_kl=t["kl"] / len(windows),
                teacher_forced_agreement=t["tf"] / len(windows),
                ratio_bf16=t["ratio"] / len(windows) if t["ratio"] else None,
            )
        )
    print(f"\n{args.dtype} KV, {len(windows)} prompts, {time.perf_counter() - started:.0f} s")
    columns = ("codec | ratio on bf16 | token agreement | teacher-forced | identical prompts | first divergence | "
               "ppl exact | ppl lossy | Δppl | mean KL")  # fmt: skip
    print(f"| {columns} |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for s in summaries:
        shown = "-" if s.ratio_bf16 is None else f"{s.ratio_bf16:.2f}x"
        print(
            f"| {s.codec} | {shown} | {100 * s.token_agreement:.1f}% | {100 * s.teacher_forced_agreement:.2f}% | "
            f"{s.identical_prompts}/{s.num_prompts} | {s.mean_first_divergence:.1f}/{GENERATED_TOKENS - 1} | "
            f"{s.ppl_exact:.4f} | {s.ppl_lossy:.4f} | {s.delta_ppl_pct:+.3f}% | {s.mean_kl:.2e} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            report = {
                "dtype": args.dtype,
                "batched_matches_engine_decode": batched_matches_engine,
                "summary": [asdict(s) for s in summaries],
                "rows": [
                    {
                        "codec": s.codec,
                        "ratio_bf16": s.ratio_bf16,
                        "token_agreement": s.token_agreement,
                        "teacher_forced_agreement": s.teacher_forced_agreement,
                        "delta_ppl_pct": s.delta_ppl_pct,
                    }
                    for s in summaries
                ],
                "prompts": per_prompt,
            }
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
