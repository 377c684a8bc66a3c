"""What every model runtime shares: the model's facts (`ModelFacts`, `check_prompt`), and the
in-process engine interface (`Engine`) that the embedded backend (`engine/hf.py`) implements.
The production backend (`engine/vllm/`) runs in a server process of its own and is driven
through `engine/vllm/remote.py`; the region agents reach either engine only through their
role's backend Protocol (`prefill_region/backend.py`, `decode_region/backend.py`).

`Engine` contract, across processes and regions:
- `prefill(token_ids, params)` runs the prompt and returns its `KVCache` and the first
  generated token (generation step 0).
- `decode(kv, first_token, params, prompt_ids)` continues from that cache and yields the
  tokens of steps 1 .. max_new_tokens - 1, stopping early after an end-of-sequence token
  (unless `params.ignore_eos`) or a stop token id. It does not repeat `first_token`.
  `prompt_ids` (the prompt the KV covers) are needed only for `repetition_penalty`.
  Stop strings are matched on the text by the caller (engine/stops.py).
- For the same model, dtype, prompt and params, `[first_token, *decode(...)]` equals
  `generate(...)` token for token, whether or not the two halves ran in one process.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from prfaas.engine.errors import InvalidPrompt, PromptTooLong
from prfaas.engine.kv import KVCache
from prfaas.engine.models import model_fingerprint, resolve_model
from prfaas.engine.sampling import Chosen, SamplingParams


@dataclass(frozen=True)
class PrefillResult:
    kv: KVCache
    first_token: int
    logits: torch.Tensor  # [vocab] float32, the logits the first token was chosen from
    first: Chosen  # first_token with its logprobs (when asked)
    firsts: tuple[Chosen, ...] = ()  # every choice's first token (params.n of them; choice 0's is `first`)
    cached_tokens: int = 0  # leading prompt tokens whose KV came from the prefix cache (not computed)

    @property
    def choices(self) -> tuple[Chosen, ...]:
        return self.firsts or (self.first,)


@dataclass(frozen=True)
class DecodeStep:
    token: int
    logits: torch.Tensor  # [vocab] float32, the logits `token` was chosen from
    chosen: Chosen  # `token` with its logprobs (when asked)


@dataclass(frozen=True)
class ModelFacts:
    """What a region checks requests and KV against, whichever engine runs the model."""

    fingerprint: str
    dtype: str
    vocab_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_context: int
    eos_token_ids: frozenset[int]  # every id that ends a generation (`end_of_sequence_ids`)
    eos_token_id: int | None = None  # the tokenizer's own, which vLLM names no stop reason for (the others: their id)

    @staticmethod
    def read(model: str | Path, dtype: str) -> ModelFacts:
        from transformers import AutoConfig, AutoTokenizer, GenerationConfig

        path = resolve_model(model)
        config: Any = AutoConfig.from_pretrained(path, local_files_only=True)
        try:
            generation: Any = GenerationConfig.from_pretrained(path, local_files_only=True)
        except OSError:  # no generation_config.json: transformers derives it from the config
            generation = GenerationConfig.from_model_config(config)
        # the tokenizer alone (no weights): its end-of-sequence token is the one vLLM stops on first
        tokenizer: Any = AutoTokenizer.from_pretrained(path, local_files_only=True)
        return ModelFacts(
            fingerprint=model_fingerprint(path),
            dtype=dtype,
            vocab_size=int(config.vocab_size),
            num_layers=int(config.num_hidden_layers),
            num_kv_heads=int(config.num_key_value_heads),
            head_dim=int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads),
            max_context=int(config.max_position_embeddings),
            eos_token_ids=end_of_sequence_ids(generation.eos_token_id, tokenizer.eos_token_id),
            eos_token_id=tokenizer.eos_token_id,
        )

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every layer for one token, in the engine's dtype."""
        itemsize = {"float32": 4, "bfloat16": 2, "float16": 2}[self.dtype]
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize


def end_of_sequence_ids(generation_eos: int | list[int] | None, tokenizer_eos: int | None) -> frozenset[int]:
    """The tokens that end a generation, as vLLM reads them: the tokenizer's `eos_token_id` (its
    primary end of sequence) and the generation config's `eos_token_id` (one id or a list)."""
    ids = generation_eos if isinstance(generation_eos, list) else [generation_eos]
    return frozenset(int(t) for t in [*ids, tokenizer_eos] if t is not None)


def check_prompt(facts: ModelFacts, token_ids: Sequence[int], params: SamplingParams) -> None:
    """InvalidPrompt / PromptTooLong unless `token_ids` is a prompt this model can run with
    `params` (both engines check the same way, so a request gets the same answer from either)."""
    if len(token_ids) == 0:
        raise InvalidPrompt("prompt is empty; at least one token is required")
    bad = [t for t in token_ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < facts.vocab_size]
    if bad:
        raise InvalidPrompt(f"token id {bad[0]!r} is outside the vocabulary [0, {facts.vocab_size})")
    if len(token_ids) + params.max_new_tokens > facts.max_context:
        raise PromptTooLong(
            f"prompt of {len(token_ids)} tokens plus max_new_tokens {params.max_new_tokens} exceeds "
            f"the model's context of {facts.max_context} tokens"
        )


class Engine(Protocol):
    @property
    def fingerprint(self) -> str: ...

    @property
    def dtype(self) -> str: ...

    @property
    def max_context(self) -> int: ...

    def prefill(self, token_ids: Sequence[int], params: SamplingParams) -> PrefillResult: ...

    def decode(
        self, kv: KVCache, first_token: int, params: SamplingParams, prompt_ids: Sequence[int] = ()
    ) -> Iterator[int]: ...

    def generate(self, token_ids: Sequence[int], params: SamplingParams) -> list[int]: ...
