"""The job's sampling specification as vLLM's `SamplingParams`, for each request a vLLM region
makes, and vLLM's logprobs back as prfaas's `Chosen` tokens.

No vLLM import: the regions build these dicts in prfaas's environment and the server
(engine/vllm/server.py) passes them to `vllm.SamplingParams(**kwargs)`.

A split job is two vLLM requests: the prefill region's (one token: step 0) and the decode
region's, whose prompt is `prompt + [first token]` (vLLM computes only that last position:
engine/vllm/params.py). Each parameter means what it means in one vLLM request, except:

- min_tokens: the prefill asks for min(min_tokens, 1), the decode for the rest;
- presence and frequency penalties count *output* tokens, and the decode request sees the
  first token as a prompt token: `FIRST_OUTPUT_KEY` in its extra_args names it, and the
  prfaas logits processor (engine/vllm/logits.py) adds its share back, so the decode's
  logits equal one vLLM request's (repetition penalty covers prompt and output alike: no
  correction);
- seeded sampling: vLLM draws from one generator per request, seeded once. The prefill's
  draw is step 0 of `seed` (the token a single vLLM request with that seed takes first);
  the decode request draws from a seed derived from it (`decode_seed`). A seeded job is
  reproducible for a placement, and a local run (one vLLM request) differs from a split one
  after the first token: vLLM's generator state cannot be handed to another request. The HF
  engine seeds each step from (seed, step) and has no such difference.
- n > 1 is refused: vLLM fans n out into n requests, and each would ship (or load) the KV.

Stop strings are not passed: the decode agent matches them on the text (engine/stops.py),
as for HF regions. Stop token ids, end of sequence and ignore_eos are passed, so vLLM ends
the request where the agent ends the stream.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

import xxhash

from prfaas.engine.blocks import block_hashes
from prfaas.engine.errors import InvalidSamplingParams
from prfaas.engine.prefix_cache import ResidencyMirror
from prfaas.engine.sampling import Chosen, SamplingParams, TokenLogprobs

FIRST_OUTPUT_KEY = "prfaas_first_output"  # extra_args: the decode prompt's last token is step 0's output
CACHE_SALT_KEY = "prfaas_cache_salt"  # the request's prefix cache scope (the host passes it with the prompt)
Role = Literal["prefill", "decode", "generate"]
# A token's logprobs as the server sends them: (logprob, rank, top ids, top logprobs).
WireLogprobs = tuple[float, int, tuple[int, ...], tuple[float, ...]]
# One generated token: (token id, its logprobs or None, the prompt's logprobs on a request's first token).
Step = tuple[int, WireLogprobs | None, list[WireLogprobs] | None]


MAX_TEMPERATURE = 2.0


def check_supported(params: SamplingParams) -> None:
    """InvalidSamplingParams (INVALID_ARGUMENT) for what a vLLM region cannot serve as asked."""
    if params.n != 1:
        raise InvalidSamplingParams(
            f"engine 'vllm' regions generate one choice per job (vLLM would prefill and ship the prompt once "
            f"per choice), got n={params.n}"
        )
    if params.temperature > MAX_TEMPERATURE:  # vLLM's own bound (SamplingParams._verify_args)
        raise InvalidSamplingParams(f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {params.temperature}")


def decode_seed(seed: int) -> int:
    """The seed of a split job's decode request (steps 1..): not `seed` itself, whose first
    draws step 0 already used."""
    return xxhash.xxh3_64_intdigest(f"{seed}/decode".encode()) & ((1 << 62) - 1)


def vllm_sampling(params: SamplingParams, role: Role, first_token: int | None = None) -> dict[str, Any]:
    """kwargs for `vllm.SamplingParams` of a `role` request (max_tokens included).
    `first_token`: a decode request's step-0 token (the last token of its prompt)."""
    check_supported(params)
    kwargs: dict[str, Any] = {
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,
        "min_p": params.min_p,
        "seed": None if params.greedy else params.seed,  # greedy: temperature 0 only (SamplingParams)
        "repetition_penalty": params.repetition_penalty,
        "presence_penalty": params.presence_penalty,
        "frequency_penalty": params.frequency_penalty,
        "stop_token_ids": list(params.stop_token_ids),
        "ignore_eos": params.ignore_eos,
        "logit_bias": dict(params.logit_bias) or None,
        "logprobs": params.logprobs,
        "max_tokens": params.max_new_tokens,
        "min_tokens": params.min_tokens,
    }
    if role == "prefill":
        kwargs.update(max_tokens=1, min_tokens=min(params.min_tokens, 1), prompt_logprobs=params.prompt_logprobs)
    elif role == "decode":
        if first_token is None:
            raise ValueError("a decode request needs its first token")
        kwargs.update(max_tokens=params.max_new_tokens - 1, min_tokens=max(params.min_tokens - 1, 0))
        if kwargs["seed"] is not None:
            kwargs["seed"] = decode_seed(kwargs["seed"])
        if params.presence_penalty or params.frequency_penalty:
            kwargs["extra_args"] = {FIRST_OUTPUT_KEY: first_token}
    else:
        kwargs["prompt_logprobs"] = params.prompt_logprobs
    return kwargs


def salted(sampling: dict[str, Any], cache_salt: str | None) -> dict[str, Any]:
    """`sampling` with the request's prefix cache scope: vLLM shares cached blocks only among requests of one
    salt. None (the job uses no prefix cache): as it is; the host gives a request without a salt one of its
    own, so it reuses nothing another request left (engine/vllm/host.py)."""
    return sampling if cache_salt is None else sampling | {CACHE_SALT_KEY: cache_salt}


def remember(mirror: ResidencyMirror | None, token_ids: Sequence[int], cache_salt: str | None) -> None:
    """Record in the region's mirror of the server's prefix cache the full blocks of `token_ids`, which the
    server now holds under `cache_salt` (a job without one: nothing another request would match)."""
    if mirror is not None and cache_salt is not None:
        mirror.keep(block_hashes(token_ids, mirror.block_tokens, cache_salt))


def wire_logprobs(entries: Mapping[int, Any], token: int, k: int) -> WireLogprobs:
    """One position of vLLM's logprobs ({token id: Logprob(logprob, rank, ...)}: the top `k`
    and `token`) as plain values, best first."""
    own = entries[token]
    top = sorted(((int(t), e) for t, e in entries.items() if e.rank is not None and e.rank <= k),
                 key=lambda item: item[1].rank)  # fmt: skip
    return (float(own.logprob), int(own.rank), tuple(t for t, _ in top), tuple(float(e.logprob) for _, e in top))


def wire_prompt_logprobs(positions: Sequence[Mapping[int, Any] | None], prompt: Sequence[int],
                         k: int) -> list[WireLogprobs]:  # fmt: skip
    """vLLM's prompt logprobs (None at position 0) for positions 1 .. len - 1."""
    return [wire_logprobs(entries, prompt[i], k) for i, entries in enumerate(positions) if i and entries is not None]


def token_logprobs(wire: WireLogprobs | None) -> TokenLogprobs | None:
    return None if wire is None else _token(wire)


def chosen(step: Step | Sequence[Any]) -> Chosen:
    token, logprobs, prompt = step
    return Chosen(int(token), token_logprobs(logprobs), tuple(_token(wire) for wire in prompt or ()))


def _token(wire: WireLogprobs) -> TokenLogprobs:
    logprob, rank, top_ids, top_logprobs = wire
    return TokenLogprobs(logprob, rank, tuple(top_ids), tuple(top_logprobs))
