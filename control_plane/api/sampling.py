"""From an OpenAI request to the job's sampling specification (engine/sampling.py), as vLLM's
OpenAI server maps it: `top_k` -1 means off, `logit_bias` keys are token ids, a chat's
`top_logprobs` needs `logprobs: true`, a completion's `logprobs` is the number of top logprobs.
Sampling (temperature > 0) without a seed gets one here, so its job can be retried or split
without changing its output. What is refused gets a 400 naming the parameter."""

from __future__ import annotations

import secrets

from prfaas.control_plane.api.errors import INVALID_REQUEST
from prfaas.control_plane.api.openai_schemas import ChatCompletionCreate, CompletionCreate
from prfaas.engine.errors import InvalidSamplingParams
from prfaas.engine.sampling import SamplingParams

Body = CompletionCreate | ChatCompletionCreate


def num_logprobs(body: Body) -> int | None:
    """Top logprobs per generated token: None = no logprobs at all."""
    if isinstance(body, CompletionCreate):
        return body.logprobs
    if body.top_logprobs and not body.logprobs:  # 0 is no top logprobs: vLLM takes it without `logprobs`
        raise INVALID_REQUEST.error("top_logprobs needs logprobs set to true", param="top_logprobs")
    return (body.top_logprobs or 0) if body.logprobs else None


def sampling_spec(body: Body, max_new_tokens: int, vocab_size: int, default_temperature: float = 0.0) -> SamplingParams:
    """The job's `SamplingParams`; 400 naming the parameter when one is out of range."""
    logprobs = num_logprobs(body)
    echo = isinstance(body, CompletionCreate) and bool(body.echo)  # with logprobs: the prompt's too
    bias: dict[int, float] = {}  # keys naming one token ("300", "0300"): the last one wins, as vLLM's int(key)
    for key, value in (body.logit_bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise INVALID_REQUEST.error(f"logit_bias: key {key[:32]!r} is not a token id", param="logit_bias") from None
        bias[token] = float(value)
    temperature = body.temperature if body.temperature is not None else default_temperature
    seed = None if body.seed is None or body.seed == -1 else body.seed % 2**63  # vLLM's int64 range, -1 = none
    seed = seed if seed is not None or temperature == 0.0 else secrets.randbits(62)
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or ())
    try:
        params = SamplingParams(
            max_new_tokens=max_new_tokens, temperature=temperature, top_p=body.top_p or 1.0,
            top_k=max(0, body.top_k or 0), min_p=body.min_p or 0.0, seed=seed, ignore_eos=bool(body.ignore_eos),
            repetition_penalty=body.repetition_penalty or 1.0, presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0, min_tokens=body.min_tokens or 0,
            stop=tuple(stop), stop_token_ids=tuple(body.stop_token_ids or ()), logit_bias=tuple(sorted(bias.items())),
            logprobs=logprobs, n=body.n or 1, prompt_logprobs=logprobs if echo else None,
        )  # fmt: skip
        params.check_vocab(vocab_size)
    except InvalidSamplingParams as exc:
        param = next((name for name in _PARAMS if str(exc).startswith(name)), None)
        hint = ""
        if param == "n" and body.temperature is None:  # OpenAI's default samples (1.0); this deployment's is greedy
            hint = f" (this deployment's default temperature is {default_temperature:g}: set temperature for n > 1)"
        raise INVALID_REQUEST.error(f"invalid request: {exc}{hint}", param=param) from None
    return params


_PARAMS = ("stop_token_ids", "logit_bias", "min_tokens", "stop", "logprobs", "temperature", "top_p", "top_k", "n")
