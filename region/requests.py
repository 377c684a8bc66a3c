"""What a region reads from a request: job ids, timeouts and sampling parameters, checked
(an `InvalidRequest` names the field), and their proto <-> engine conversions."""

from __future__ import annotations

import uuid
from collections.abc import Sequence

from prfaas.engine.sampling import Chosen, SamplingParams, TokenLogprobs
from prfaas.protos.prfaas.v1 import common_pb2
from prfaas.region.errors import Canceled, InvalidRequest

MAX_TIMEOUT_S = 3600.0  # the longest deadline any region call may ask for (seconds)
MAX_RESHIPS = 8  # Reship calls a prefill region serves at once (each holds a gRPC thread; past it RESOURCE_EXHAUSTED)


def job_uuid(value: str) -> str:
    """The canonical form of a job id; InvalidRequest unless it is a UUID."""
    try:
        return str(uuid.UUID(value))
    except ValueError:
        raise InvalidRequest(f"job_id must be a UUID, got {value[:64]!r}") from None


def timeout_from(value: float, *, default_s: float, max_s: float, field: str = "timeout_s") -> float:
    """A request's timeout: 0 (unset) means `default_s`; it must be > 0 and at most `max_s`."""
    if value == 0:
        return default_s
    if not 0 < value <= max_s:  # also rejects NaN
        raise InvalidRequest(f"{field} must be in (0, {max_s:g}] seconds, got {value}")
    return value


def sampling_from_proto(msg: common_pb2.SamplingParams) -> SamplingParams:
    """InvalidSamplingParams (INVALID_ARGUMENT) names the field out of range."""
    return SamplingParams(
        max_new_tokens=msg.max_new_tokens,
        temperature=msg.temperature,
        top_p=msg.top_p or 1.0,
        top_k=msg.top_k,
        min_p=msg.min_p,
        seed=msg.seed if msg.HasField("seed") else None,
        ignore_eos=msg.ignore_eos,
        repetition_penalty=msg.repetition_penalty or 1.0,
        presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty,
        min_tokens=msg.min_tokens,
        stop=tuple(msg.stop),
        stop_token_ids=tuple(msg.stop_token_ids),
        logit_bias=tuple(sorted(msg.logit_bias.items())),
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
        n=msg.n or 1,
        prompt_logprobs=msg.prompt_logprobs if msg.HasField("prompt_logprobs") else None,
    )


def sampling_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(
        max_new_tokens=params.max_new_tokens, temperature=params.temperature, top_p=params.top_p,
        top_k=params.top_k, min_p=params.min_p, ignore_eos=params.ignore_eos,
        repetition_penalty=params.repetition_penalty, presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty, min_tokens=params.min_tokens, stop=list(params.stop),
        stop_token_ids=list(params.stop_token_ids), logit_bias=dict(params.logit_bias), n=params.n,
    )  # fmt: skip
    if params.seed is not None:
        msg.seed = params.seed
    if params.logprobs is not None:
        msg.logprobs = params.logprobs
    if params.prompt_logprobs is not None:
        msg.prompt_logprobs = params.prompt_logprobs
    return msg


def logprobs_to_proto(logprobs: TokenLogprobs | None) -> common_pb2.TokenLogprobs | None:
    return None if logprobs is None else _logprobs_message(logprobs)


def _logprobs_message(logprobs: TokenLogprobs) -> common_pb2.TokenLogprobs:
    return common_pb2.TokenLogprobs(
        logprob=logprobs.logprob, rank=logprobs.rank, top_ids=logprobs.top_ids, top_logprobs=logprobs.top_logprobs
    )


def logprobs_from_proto(msg: common_pb2.TokenLogprobs) -> TokenLogprobs:
    return TokenLogprobs(msg.logprob, msg.rank, tuple(msg.top_ids), tuple(msg.top_logprobs))


def prompt_logprobs_to_proto(first: Chosen) -> list[common_pb2.TokenLogprobs]:
    return [_logprobs_message(p) for p in first.prompt]


def firsts_to_proto(firsts: Sequence[Chosen]) -> list[common_pb2.FirstToken]:
    """Every choice's first token, for a PrefillDone / ReshipReply (none when there is one choice:
    `first_token` and `first_logprobs` say it)."""
    if len(firsts) <= 1:
        return []
    return [common_pb2.FirstToken(token=f.token, logprobs=logprobs_to_proto(f.logprobs)) for f in firsts]


def firsts_from_proto(first_token: int, first_logprobs: common_pb2.TokenLogprobs | None,
                      choices: Sequence[common_pb2.FirstToken],
                      prompt: Sequence[common_pb2.TokenLogprobs] = ()) -> list[Chosen]:  # fmt: skip
    """Every choice's first token from a message's `first_token`, `first_logprobs` and `choices`
    (choice 0's with the prompt's logprobs, `prompt`)."""
    prompt_logprobs = tuple(logprobs_from_proto(p) for p in prompt)
    if not choices:
        logprobs = logprobs_from_proto(first_logprobs) if first_logprobs is not None else None
        return [Chosen(first_token, logprobs, prompt_logprobs)]
    firsts = [Chosen(c.token, logprobs_from_proto(c.logprobs) if c.HasField("logprobs") else None) for c in choices]
    return [Chosen(firsts[0].token, firsts[0].logprobs, prompt_logprobs), *firsts[1:]]


def cancel_of(request: common_pb2.CancelRequest) -> tuple[str, Canceled]:
    """A Cancel call's job id (checked) and the error the job ends with (its attempt: `request.attempt`)."""
    return job_uuid(request.job_id), Canceled(f"canceled: {request.reason or 'by the caller'}")


def stops(attempt: int, of: int) -> bool:
    """Whether a Cancel of `attempt` (0: every attempt) stops work of attempt `of` (0: unknown): its own and
    older attempts', never a newer one's (the Cancel is stale)."""
    return not attempt or of <= attempt
