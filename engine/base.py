"""The engine interface every model runtime implements (HF today, vLLM later).

Contract, across processes and regions:
- `prefill(token_ids, params)` runs the prompt and returns its `KVCache` and the first
  generated token (generation step 0).
- `decode(kv, first_token, params)` continues from that cache and yields the tokens of
  steps 1 .. max_new_tokens - 1, stopping early at an end-of-sequence token unless
  `params.ignore_eos`. It does not repeat `first_token`.
- For the same model, dtype, prompt and params, `[first_token, *decode(...)]` equals
  `generate(...)` token for token, whether or not the two halves ran in one process.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from prfaas.engine.kv import KVCache
from prfaas.engine.sampling import SamplingParams


@dataclass(frozen=True)
class PrefillResult:
    kv: KVCache
    first_token: int
    logits: torch.Tensor  # [vocab] float32, the logits the first token was chosen from


@dataclass(frozen=True)
class DecodeStep:
    token: int
    logits: torch.Tensor  # [vocab] float32, the logits `token` was chosen from


class Engine(Protocol):
    @property
    def fingerprint(self) -> str: ...

    @property
    def dtype(self) -> str: ...

    @property
    def max_context(self) -> int: ...

    def prefill(self, token_ids: Sequence[int], params: SamplingParams) -> PrefillResult: ...

    def decode(self, kv: KVCache, first_token: int, params: SamplingParams) -> Iterator[int]: ...

    def generate(self, token_ids: Sequence[int], params: SamplingParams) -> list[int]: ...
