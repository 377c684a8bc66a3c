"""Sampling parameters and the next-token choice.

Sampling must give the same tokens whether prefill and decode run in one process or in
two regions. So the random stream is not carried over from step to step: the generator
for step `i` (0 = the first token, chosen at the end of prefill) is seeded from
`(seed, i)` alone. Same logits + same `(seed, i)` -> same token, wherever it runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import xxhash

from prfaas.engine.errors import InvalidSamplingParams


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens.

    max_new_tokens: tokens to generate, counting the first one chosen at prefill (>= 1).
    temperature: 0 means greedy (argmax); > 0 samples from softmax(logits / temperature).
    top_p: nucleus sampling mass in (0, 1]; 1 keeps the whole distribution.
    seed: required when temperature > 0; the control plane assigns one when a client
        does not, so a request can be replayed or split without changing its output.
    ignore_eos: keep generating past end-of-sequence tokens (benchmarks, equality tests).
    """

    max_new_tokens: int = 32
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise InvalidSamplingParams(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not self.temperature >= 0.0:  # also rejects NaN
            raise InvalidSamplingParams(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidSamplingParams(f"top_p must be in (0, 1], got {self.top_p}")
        if self.temperature > 0.0 and self.seed is None:
            raise InvalidSamplingParams("seed is required when temperature > 0")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _step_generator(seed: int, step: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(xxhash.xxh3_64_intdigest(f"{seed}:{step}".encode()) & ((1 << 63) - 1))
    return g


def sample_next(logits: torch.Tensor, params: SamplingParams, step: int) -> int:
    """Choose the token for generation step `step` from logits [vocab]."""
    if params.greedy:
        return int(torch.argmax(logits).item())
    assert params.seed is not None  # enforced by SamplingParams
    probs = torch.softmax(logits.double() / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True, stable=True)
        # Keep the smallest prefix whose mass reaches top_p (always at least one token).
        keep = (torch.cumsum(sorted_probs, dim=-1) - sorted_probs) < params.top_p
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_probs[keep])
    choice = torch.multinomial(probs, 1, generator=_step_generator(params.seed, step))
    return int(choice.item())
