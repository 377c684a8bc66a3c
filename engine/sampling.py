"""The sampling specification and the next-token choice, as vLLM (v1) defines them.

One `SamplingParams` travels with a job from the API to both regions: the first token is
chosen at the end of prefill (step 0), the rest in the decode region, so both must apply it
identically. `choose` is that rule, in vLLM's order:

1. logprobs, when asked, of the raw logits (vLLM's default `logprobs_mode="raw_logprobs"`):
   before any processing below;
2. min_tokens: while fewer than `min_tokens` tokens were generated, the stop token ids and the
   end-of-sequence ids cannot be chosen (even with `ignore_eos`, as in vLLM); logit_bias is added;
3. penalties: repetition (over prompt and output: positive logits divided by it, negative ones
   multiplied), then frequency (x count in the output) and presence (x 1 if in the output);
4. greedy (temperature 0; vLLM raises 0 < T < 0.01 to 0.01) takes the argmax here, ties to the lowest id;
5. else temperature, min_p, top_k, top_p, then a draw.

The random stream is not carried over from step to step: the generator for step `i` is seeded
from `(seed, i)` alone. Same logits + same history + same `(seed, i)` -> same token, wherever
it runs.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import xxhash

from prfaas.engine.errors import InvalidSamplingParams

MAX_LOGPROBS = 20  # top logprobs per token, as OpenAI bounds it
MAX_N = 16  # choices per prompt: each decodes from its own copy of the prompt's KV
MAX_STOP = 16  # stop strings and stop token ids, each
MAX_STOP_CHARS = 256


MIN_TEMPERATURE = 0.01  # vLLM's _MAX_TEMP: a temperature in (0, 0.01) is raised to it (only 0 is greedy)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens (units: tokens; probabilities in [0, 1]).

    max_new_tokens: tokens to generate, counting the first one chosen at prefill (>= 1).
    temperature: 0 means greedy (argmax); > 0 samples from softmax(logits / temperature); one in
        (0, MIN_TEMPERATURE) is raised to MIN_TEMPERATURE, as vLLM's SamplingParams does.
    top_p: nucleus mass in (0, 1]; top_k: keep the k most likely (0 = all); min_p: keep tokens
        at least min_p x the most likely one's probability (0 = all). Sampling only.
    seed: required when temperature > 0; the control plane assigns one when a client does
        not, so a request can be replayed or split without changing its output.
    ignore_eos: keep generating past end-of-sequence tokens.
    repetition_penalty (> 0, 1 = off), presence_penalty and frequency_penalty ([-2, 2], 0 =
        off): applied to greedy and sampled choices alike, as vLLM does.
    min_tokens: no stop token, end of sequence (ignore_eos or not) or stop string before this many tokens.
    stop: strings that end generation when the output text contains one (the text is cut
        before it); matched by the region that decodes (engine/stops.py).
    stop_token_ids: tokens that end generation (the token is kept, its text is not shown).
    logit_bias: (token id, bias) pairs added to the logits at every step.
    logprobs: None = none; k >= 0 = the chosen token's logprob and the k most likely ones.
    n: choices generated from the one prefill (each decodes on its own; `for_choice`).
    prompt_logprobs: None = none; k >= 0 = each prompt token's logprob (but the first's) and the
        k most likely there, computed where the prompt is prefilled (a completion's echo).
    """

    max_new_tokens: int = 32
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None
    n: int = 1
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        def bad(message: str) -> InvalidSamplingParams:
            return InvalidSamplingParams(message)

        if self.max_new_tokens < 1:
            raise bad(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not 0.0 <= self.temperature < math.inf:  # also rejects NaN
            raise bad(f"temperature must be >= 0 and finite, got {self.temperature}")
        if 0.0 < self.temperature < MIN_TEMPERATURE:  # vLLM's __post_init__, before its greedy check
            object.__setattr__(self, "temperature", MIN_TEMPERATURE)
        if not 0.0 < self.top_p <= 1.0:
            raise bad(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise bad(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad(f"min_p must be in [0, 1], got {self.min_p}")
        if self.temperature > 0.0 and self.seed is None:
            raise bad("seed is required when temperature > 0")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise bad(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise bad(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0 <= self.min_tokens <= self.max_new_tokens:
            raise bad(f"min_tokens must be in [0, max_new_tokens={self.max_new_tokens}], got {self.min_tokens}")
        if len(self.stop) > MAX_STOP or any(not s or len(s) > MAX_STOP_CHARS for s in self.stop):
            raise bad(f"stop takes at most {MAX_STOP} non-empty strings of at most {MAX_STOP_CHARS} characters")
        if len(self.stop_token_ids) > MAX_STOP or any(t < 0 for t in self.stop_token_ids):
            raise bad(f"stop_token_ids takes at most {MAX_STOP} token ids >= 0")
        if any(not -100.0 <= b <= 100.0 for _, b in self.logit_bias):
            raise bad("logit_bias values must be in [-100, 100]")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise bad(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise bad(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}")
        if not 1 <= self.n <= MAX_N:
            raise bad(f"n must be in [1, {MAX_N}], got {self.n}")
        if self.n > 1 and self.greedy:  # as vLLM: n identical choices are a client's mistake
            raise bad(f"n must be 1 when using greedy sampling, got {self.n}")

    def for_choice(self, choice: int) -> SamplingParams:
        """The parameters choice `choice` (0 .. n-1) is generated with: choice 0 keeps the seed, the
        others draw from seeds derived from it, so the n choices differ when sampling and are each
        reproducible wherever they run (greedy choices are all the same, as in vLLM)."""
        if self.n == 1 and choice == 0:
            return self
        seed = self.seed
        if seed is not None and choice:
            seed = xxhash.xxh3_64_intdigest(f"{seed}/choice{choice}".encode()) & ((1 << 62) - 1)
        return dataclasses.replace(self, seed=seed, n=1)

    @property
    def greedy(self) -> bool:
        """Argmax: temperature 0 (any other is at least MIN_TEMPERATURE), as vLLM reads it."""
        return self.temperature == 0.0

    def to_dict(self) -> dict[str, Any]:
        """JSON-able: what a job record stores (`from_dict` reads it back)."""
        return dataclasses.asdict(self)

    @staticmethod
    def from_dict(data: dict[str, Any]) -> SamplingParams:
        fields = dict(data)
        for name in ("stop", "stop_token_ids"):
            fields[name] = tuple(fields.get(name) or ())
        fields["logit_bias"] = tuple((int(t), float(b)) for t, b in fields.get("logit_bias") or ())
        return SamplingParams(**fields)

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def check_vocab(self, vocab_size: int) -> None:
        """InvalidSamplingParams unless every token id it names is in [0, vocab_size)."""
        for name, ids in (("stop_token_ids", self.stop_token_ids), ("logit_bias", [t for t, _ in self.logit_bias])):
            bad = next((t for t in ids if not 0 <= t < vocab_size), None)
            if bad is not None:
                raise InvalidSamplingParams(f"{name}: token id {bad} is outside the vocabulary [0, {vocab_size})")


@dataclass(frozen=True)
class TokenLogprobs:
    """A chosen token's logprob (of the raw logits), its rank (1 = most likely) and the `k`
    most likely tokens with theirs, best first."""

    logprob: float
    rank: int
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


@dataclass(frozen=True)
class Chosen:
    """One generated token, with its logprobs when the request asked for them; the first token of
    a generation also carries its prompt's logprobs when asked (positions 1 .. len - 1)."""

    token: int
    logprobs: TokenLogprobs | None = None
    prompt: tuple[TokenLogprobs, ...] = ()


@dataclass(frozen=True)
class History:
    """What penalties and min_tokens read: the prompt and the tokens generated so far."""

    prompt: Sequence[int] = ()
    output: Sequence[int] = ()


def _step_generator(seed: int, step: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(xxhash.xxh3_64_intdigest(f"{seed}:{step}".encode()) & ((1 << 63) - 1))
    return g


def token_logprobs(logits: torch.Tensor, token: int, k: int) -> TokenLogprobs:
    """Logprobs of raw `logits` [vocab]: `token`'s, its rank, and the top `k`. The rank counts the
    tokens at least as likely as `token`, itself included, as vLLM does: a tie ranks last among equals."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = float(logprobs[token])
    rank = int((logprobs >= chosen).sum().item())
    if k == 0:
        return TokenLogprobs(chosen, rank)
    values, ids = torch.topk(logprobs, k)
    return TokenLogprobs(chosen, rank, tuple(int(i) for i in ids.tolist()), tuple(float(v) for v in values.tolist()))


def process(logits: torch.Tensor, params: SamplingParams, history: History, eos_ids: frozenset[int]) -> torch.Tensor:
    """Steps 2-3 of the rule (min_tokens, logit_bias, penalties): a new float32 tensor."""
    out = logits.float().clone()
    if len(history.output) < params.min_tokens:
        stops = set(params.stop_token_ids) | set(eos_ids)  # vLLM's _all_stop_token_ids: EOS even under ignore_eos
        if stops:
            out[list(stops)] = float("-inf")
    if params.logit_bias:
        ids = torch.tensor([t for t, _ in params.logit_bias], dtype=torch.long)
        out.index_add_(0, ids, torch.tensor([b for _, b in params.logit_bias], dtype=out.dtype))
    if params.penalized:
        vocab = out.shape[0]
        output = torch.tensor(list(history.output), dtype=torch.long)
        counts = torch.bincount(output, minlength=vocab)[:vocab].to(out.dtype)
        seen_out = counts > 0
        if params.repetition_penalty != 1.0:
            seen = seen_out.clone()
            if history.prompt:
                seen[torch.tensor(list(history.prompt), dtype=torch.long)] = True
            penalty = torch.where(seen, params.repetition_penalty, 1.0).to(out.dtype)
            out *= torch.where(out > 0, 1.0 / penalty, penalty)
            out.clamp_(max=torch.finfo(out.dtype).max)  # a tiny penalty overflows a positive logit: inf, then NaN
        out -= params.frequency_penalty * counts
        out -= params.presence_penalty * seen_out.to(out.dtype)
    return out


def choose(
    logits: torch.Tensor, params: SamplingParams, step: int, history: History = History(),
    eos_ids: frozenset[int] = frozenset(),
) -> Chosen:  # fmt: skip
    """The token for generation step `step` from `logits` [vocab], and its logprobs if asked."""
    token = _pick(process(logits, params, history, eos_ids), params, step)
    if params.logprobs is None:
        return Chosen(token)
    return Chosen(token, token_logprobs(logits, token, params.logprobs))


def sample_next(logits: torch.Tensor, params: SamplingParams, step: int) -> int:
    """Choose the token for generation step `step` from logits [vocab] (no history)."""
    return choose(logits, params, step).token


def _pick(logits: torch.Tensor, params: SamplingParams, step: int) -> int:
    if params.greedy:
        return int(torch.argmax(logits).item())
    assert params.seed is not None  # enforced by SamplingParams
    scores = logits.double() / params.temperature
    if params.min_p > 0.0:
        probs = torch.softmax(scores, dim=-1)
        scores = scores.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
    if 0 < params.top_k < scores.shape[0]:
        kth = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True, stable=True)
        # Keep the smallest prefix whose mass reaches top_p (always at least one token).
        keep = (torch.cumsum(sorted_probs, dim=-1) - sorted_probs) < params.top_p
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_probs[keep])
    choice = torch.multinomial(probs, 1, generator=_step_generator(params.seed, step))
    return int(choice.item())
