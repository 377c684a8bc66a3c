"""OpenAI-compatible routes: `/v1/completions`, `/v1/chat/completions` (the model's chat
template), `stream=true` as server-sent events, `usage`, `/v1/models`.

Admission, cheapest first, so that a refused request costs no tokenizer time: model known (404),
`max_tokens` within limits, the sampling parameters (api/sampling.py) and a token-id prompt within
the vocabulary and the context (400), placement allowed for the tenant (403); then one Redis step
(`JobStore.admit`): Idempotency-Key (a replay answers from its job; the key with another body: 422),
budget headroom (402), concurrency (429) and rate (429). Only then is the prompt tokenized and
checked (400; the admission's slot and rate count are given back), the job placed, its predicted $
reserved in the budget (402 when it does not fit) and the job written (`JobStore.create`). The job
is then queued for dispatch and its tokens streamed back here, each choice's text built as vLLM
builds it (api/choices.py). A list of prompts is a job per prompt. Error bodies: api/errors.py."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import time
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from typing import Any

import kombu.exceptions
import redis
from fastapi import APIRouter
from fastapi.responses import StreamingResponse

from prfaas.control_plane.api.attach import attach, attached_anyway
from prfaas.control_plane.api.choices import Choice, usage
from prfaas.control_plane.api.deps import Generation, GenerationDep, ServicesDep, TenantDep
from prfaas.control_plane.api.errors import (
    ADMISSION_REFUSALS,
    BATCH_TOO_LARGE,
    INVALID_REQUEST,
    PLACEMENT_NOT_ALLOWED,
    PROMPT_EMPTY,
    PROMPT_TOO_LONG,
    STORE_UNAVAILABLE,
    TOKEN_OUT_OF_VOCAB,
    UNKNOWN_KV_CODEC,
    ApiError,
    model_not_found,
)
from prfaas.control_plane.api.openai_schemas import ChatCompletionCreate, CompletionCreate
from prfaas.control_plane.api.sampling import sampling_spec
from prfaas.control_plane.api.sse import (
    ClosingStreamingResponse,
    PromptJob,
    cancel_batch,
    client_gone,
    completion_tokens,
    ended_error,
    sse,
)
from prfaas.control_plane.api.unary import AnswerResponse
from prfaas.control_plane.jobs.attached import AttachedReader
from prfaas.control_plane.jobs.celery_app import enqueue
from prfaas.control_plane.jobs.errors import AdmissionRefused, JobEnded
from prfaas.control_plane.jobs.objectives import LOSSLESS, job_fields
from prfaas.control_plane.jobs.prefix import prefix_fields
from prfaas.control_plane.jobs.store import Admission, HandedOff
from prfaas.control_plane.services import ChatTemplateError, ServedModel, Services
from prfaas.control_plane.tenants import Objectives
from prfaas.engine.sampling import SamplingParams
from prfaas.telemetry import tracing

log = logging.getLogger(__name__)
router = APIRouter(prefix="/v1", tags=["openai"])
MAX_TOKENS_ZERO = "invalid request: max_tokens: Input should be greater than or equal to 1 (0 with echo only)"
Prompt = list[int] | Callable[[], list[int]]  # token ids, or how to tokenize the prompt (after admission)
Body = CompletionCreate | ChatCompletionCreate


@router.get("/models")
def list_models(_tenant: TenantDep, s: ServicesDep) -> dict[str, Any]:
    """The served model; `prfaas.kv_codecs`: the codecs its KV may cross the WAN in, with each lossy one's
    measured quality (what `prfaas.kv_codec` consents to)."""
    model = {"id": s.model.name, "object": "model", "created": 0, "owned_by": "prfaas",
             "prfaas": {"kv_codecs": s.kv_codecs}}  # fmt: skip
    return {"object": "list", "data": [model]}


@router.post("/completions", response_model=None)
def create_completion(body: CompletionCreate, g: GenerationDep) -> AnswerResponse | StreamingResponse:
    model = _served_model(g.services, body.model)
    if body.max_tokens == 0 and not body.echo:
        raise INVALID_REQUEST.error(MAX_TOKENS_ZERO, param="max_tokens")
    prompts: list[str | list[int]]
    if isinstance(body.prompt, str) or (body.prompt and isinstance(body.prompt[0], int)):
        prompts = [body.prompt]  # type: ignore[list-item]
    else:
        prompts = list(body.prompt)  # type: ignore[arg-type]
    runs: list[tuple[Prompt, str]] = []
    for prompt in prompts:
        if isinstance(prompt, list):
            if max(prompt) >= len(model.tokenizer):
                raise TOKEN_OUT_OF_VOCAB.error(param="prompt")
            runs.append((prompt, model.decode_prompt(prompt) if body.echo else ""))
        else:
            runs.append((_encoder(model, prompt), prompt if body.echo else ""))
    return _run(g, body, runs, 1 if body.echo_only else body.max_tokens, "text_completion")


@router.post("/chat/completions", response_model=None)
def create_chat_completion(body: ChatCompletionCreate, g: GenerationDep) -> AnswerResponse | StreamingResponse:
    model = _served_model(g.services, body.model)
    messages = [m.for_template() for m in body.messages]

    def encoded() -> list[int]:
        try:
            return model.encode_chat(messages, body.add_generation_prompt, body.continue_final_message,
                                     body.chat_template_kwargs)  # fmt: skip
        except ChatTemplateError as exc:
            raise INVALID_REQUEST.error(f"invalid request: messages: {exc}", param="messages") from None

    runs: list[tuple[Prompt, str]] = [(encoded, "")]
    return _run(g, body, runs, body.max_completion_tokens or body.max_tokens, "chat.completion")


def _encoder(model: ServedModel, text: str) -> Callable[[], list[int]]:
    return lambda: model.encode(text)


def _served_model(s: Services, model: str | None) -> ServedModel:
    """The model asked for; none asked (omitted, null, ""): the served one, as vLLM answers it."""
    if model and model != s.model.name:
        raise model_not_found(model, s.model.name)
    return s.model


def _param(kind: str) -> str:
    return "messages" if kind == "chat.completion" else "prompt"


def _too_long(tokens: int, context: int, kind: str) -> ApiError:
    return PROMPT_TOO_LONG.error(f"prompt too long for the model: {tokens} tokens, and its context is {context} "
                                 "(a prompt must leave room for one token)", param=_param(kind))  # fmt: skip


def _body_hash(g: Generation, body: Body, kind: str) -> str:
    """SHA-256 of the request as the API reads it (route, placement header, the body's fields in schema
    order with defaults filled in): what an Idempotency-Key is bound to."""
    canonical = f"{kind}\n{g.placement or ''}\n{body.model_dump_json()}"
    return hashlib.sha256(canonical.encode()).hexdigest()


def _refused(g: Generation, exc: AdmissionRefused) -> ApiError:
    g.metrics.refused.labels(exc.reason).inc()
    return ADMISSION_REFUSALS[exc.reason].error()


def _run(
    g: Generation, body: Body, runs: list[tuple[Prompt, str]], max_tokens: int | None, kind: str
) -> AnswerResponse | StreamingResponse:
    """One job per prompt (`runs`: the prompt, and the text a completion's `echo` shows), then the
    response: `n` choices per prompt, `index` = prompt x n + choice (OpenAI's numbering). A batch's
    prompts run side by side; one refused at admission ends the others (a batch is one request)."""
    s, tenant = g.services, g.tenant
    limit, context = s.settings.max_new_tokens_limit, s.model.max_context
    # none asked: a completion's default (OpenAI's and vLLM's 16), a chat's what the context leaves (vLLM's)
    max_new = max_tokens or (min(limit, context) if kind == "chat.completion" else s.settings.default.max_tokens)
    field = "max_completion_tokens" if getattr(body, "max_completion_tokens", None) else "max_tokens"
    if max_tokens and max_tokens > context:  # vLLM's check; past what the prompt leaves: shortened (`_create`)
        raise INVALID_REQUEST.error(f"invalid request: {field}: {max_tokens} is more than the model's context "
                                    f"({context} tokens)", param=field)  # fmt: skip
    if max_tokens and max_tokens > limit:  # the operator's cap
        raise INVALID_REQUEST.error(f"invalid request: {field}: {max_tokens} is more than this deployment allows "
                                    f"({limit}, max_new_tokens_limit)", param=field)  # fmt: skip
    params = sampling_spec(body, max_new, len(s.model.tokenizer), s.settings.default.temperature)
    for prompt, _ in runs:
        if isinstance(prompt, list) and len(prompt) >= context:
            raise _too_long(len(prompt), context, kind)
    placement = g.placement or (body.prfaas.placement if body.prfaas else "auto")
    if placement != "auto" and not tenant.allow_placement:
        raise PLACEMENT_NOT_ALLOWED.error(param="prfaas.placement")
    codec = body.prfaas.kv_codec if body.prfaas else None
    if codec is not None and codec != LOSSLESS and codec not in s.lossy_codecs:
        raise UNKNOWN_KV_CODEC.error(param="prfaas.kv_codec")
    at_once = min(tenant.quota.concurrency, max(1, int(tenant.quota.rps)))  # what admission can let in at once
    too_large = len(runs) > at_once  # never admitted whole: a 429 (retried by clients) would come each time
    if too_large and not (g.idempotency_key and s.jobs.key_used(tenant.id, g.idempotency_key)):  # a replay attaches
        raise BATCH_TOO_LARGE.error(f"batch too large: {len(runs)} prompts, and this tenant's limits (concurrency "
                                    f"{tenant.quota.concurrency}, {tenant.quota.rps:g} requests/s) admit at most "
                                    f"{at_once} at once; send fewer prompts per request", param="prompt")  # fmt: skip
    jobs: list[PromptJob] = []
    try:
        for index, (prompt, echo) in enumerate(runs):
            # a batch's later prompts: the key and "\n" + the index, which no header value can hold (a client's
            # own key "K:1" must never name prompt 1 of the batch sent with key "K")
            key = g.idempotency_key and (g.idempotency_key if index == 0 else f"{g.idempotency_key}\n{index}")
            n, chat = params.n, kind == "chat.completion"
            echo_only = isinstance(body, CompletionCreate) and body.echo_only
            choices = [Choice(s.model, params, chat, index * n + c, echo, echo_only) for c in range(n)]  # OpenAI's
            jobs.append(_start(g, body, prompt, params, placement, kind, key, choices))
    except BaseException:
        refused = "another prompt of the request was refused"
        for job in jobs:  # the prompts already started end with the request
            if job.leader:
                with contextlib.suppress(redis.RedisError):
                    g.follower.cancel(job.job_id, refused)
            if isinstance(job.stream, tracing.Spanned):  # never read: its job's span ends here
                job.stream.close(refused)
            elif isinstance(job.stream, AttachedReader):  # attached: no longer counted as the job's reader
                job.stream.close()
        raise
    return _respond(g, body, jobs, kind)


def _start(
    g: Generation, body: Body, prompt: Prompt, params: SamplingParams, placement: str, kind: str,
    key: str | None, choices: list[Choice],
) -> PromptJob:  # fmt: skip
    received = time.perf_counter()
    span = tracing.tracer.start_span("api.job", kind=tracing.SpanKind.SERVER,
                                     attributes={"prfaas.kind": kind, "prfaas.tenant": g.tenant.id})  # fmt: skip
    try:
        job = _admitted(g, body, prompt, params, placement, kind, key, choices, received, span)
    except BaseException as exc:
        tracing.end(span, exc)
        raise
    if not job.leader:
        tracing.end(span)
        return job
    job.stream = tracing.Spanned(span, job.stream)  # the job's span ends with its stream, read or not
    return job


def _admitted(
    g: Generation, body: Body, prompt: Prompt, params: SamplingParams, placement: str, kind: str,
    key: str | None, choices: list[Choice], received: float, span: tracing.Span,
) -> PromptJob:  # fmt: skip
    s, tenant = g.services, g.tenant
    body_hash = _body_hash(g, body, kind) if key else ""
    admitting = time.time_ns()
    try:
        admission = s.jobs.admit(tenant.id, tenant.quota, idempotency_key=key, body_hash=body_hash)
    except AdmissionRefused as exc:
        raise _refused(g, exc) from None
    span.set_attribute(tracing.JOB_ID, admission.job_id)
    tracing.span_at("api.admission", span, admitting, time.time_ns(),
                    {tracing.JOB_ID: admission.job_id, "prfaas.replay": admission.existing})  # fmt: skip
    if admission.existing:
        attached = attach(g, admission.job_id, choices)
        if attached is not None:
            return attached
        try:  # its job was canceled as its client left, before this request counted as its reader: a fresh one
            admission = s.jobs.admit(tenant.id, tenant.quota, idempotency_key=key, body_hash=body_hash)
        except AdmissionRefused as exc:
            raise _refused(g, exc) from None
        span.set_attribute(tracing.JOB_ID, admission.job_id)
        if admission.existing:  # a concurrent retry's fresh job
            return attached_anyway(g, admission.job_id, choices)
    try:  # from here on, a refusal gives the admission's slot and rate count back
        ids = prompt if isinstance(prompt, list) else g.metrics.tokenize(prompt)
        job_id, handed_off, record = _create(g, body, admission, ids, params, placement, kind, span)
    except AdmissionRefused as exc:
        s.jobs.release(admission)
        raise _refused(g, exc) from None
    except BaseException:
        s.jobs.release(admission)
        raise
    if record is None:  # a concurrent request with the same Idempotency-Key and body created the job
        return attached_anyway(g, job_id, choices)
    failed = ""
    try:  # from here on, a request that fails ends its job: nothing else would (this process follows it)
        g.metrics.admission_s.labels(kind).observe(time.perf_counter() - received)
        for choice in choices:
            choice.prompt_ids = ids
        ready: dict[str, Any] | None = None
        if handed_off is not None:
            ready = {"attempt": 1} | handed_off.ready
        else:
            try:
                enqueue(g.follower.celery, job_id)
            except kombu.exceptions.OperationalError:  # the broker (Redis) is away: the job never runs
                failed = "broker unreachable at dispatch"
                raise STORE_UNAVAILABLE.error() from None
            record = None
        tokens = g.follower.tokens(job_id, record, ready, parent=span, followed=True)  # followed from its creation
    except BaseException as exc:  # FAILED on a thread, once Redis answers
        g.follower.abandon(job_id, failed or f"its request failed before its tokens were read ({type(exc).__name__})")
        raise
    return PromptJob(job_id, tokens, len(ids), choices, leader=True)


def _create(
    g: Generation, body: Body, admission: Admission, ids: list[int], params: SamplingParams, placement: str,
    kind: str, span: tracing.Span,
) -> tuple[str, HandedOff | None, dict[str, str] | None]:  # fmt: skip
    """Check the tokenized prompt, place the job, reserve its predicted $ and write it: (job id, its
    hand-off when placed locally at admission, its record; None when another request's job answers)."""
    s, tenant = g.services, g.tenant
    if not ids:
        raise PROMPT_EMPTY.error(param=_param(kind))
    if len(ids) >= s.model.max_context:
        raise _too_long(len(ids), s.model.max_context, kind)
    max_new = min(params.max_new_tokens, s.model.max_context - len(ids))  # what the context leaves, as vLLM
    if max_new < params.max_new_tokens:
        if params.min_tokens > max_new:
            message = f"invalid request: min_tokens: {params.min_tokens} is more than the context leaves ({max_new})"
            raise INVALID_REQUEST.error(message, param="min_tokens")
        params = dataclasses.replace(params, max_new_tokens=max_new)
    fields: dict[str, Any] = {
        "model": s.model.name, "kind": kind, "token_ids": ids, "prompt_tokens": len(ids), "max_new_tokens": max_new,
        "temperature": params.temperature, "placement_asked": placement, "sampling": params.to_dict(),
    }  # fmt: skip
    fields |= (blocks := prefix_fields(ids, tenant.id, s.settings, body.cache_salt))
    options = body.prfaas
    asked_objectives = Objectives(options.ttft_slo_ms, options.tpot_slo_ms, options.kv_codec) if options else None
    fields |= (objectives := job_fields(asked_objectives or Objectives(), tenant.objectives, s.settings))
    if params.seed is not None:
        fields["seed"] = params.seed
    if body.user:
        fields["user"] = body.user
    if g.idempotency_key:  # a retry can attach to it: adopted if its API process dies (jobs/sweeper.py)
        fields["idempotent"] = 1
    if trace := tracing.traceparent(span):  # whoever dispatches or retries the job continues its trace
        fields["trace"] = trace
    asked = {"id": admission.job_id, "tenant": tenant.id, "prompt_tokens": str(len(ids))}
    # the decode work placed and reserved for: n choices of up to max_new tokens each (one prefill)
    asked |= {"max_new_tokens": str(max_new * params.n), "placement_asked": placement} | blocks  # not 100k ids
    asked |= objectives
    placing = time.time_ns()
    placed = g.follower.placer.place(asked, hand_off=s.settings.admission.placement)
    tracing.span_at("api.placement", span, placing, time.time_ns(), {
        tracing.JOB_ID: admission.job_id, "prfaas.placement": str(placed.fields.get("placement_chosen", "dispatched"))
    })  # fmt: skip
    created = s.jobs.create(
        tenant.id, fields | placed.fields, tenant.quota, handed_off=placed.handed_off, admission=admission,
        reserve_usd=placed.predicted_usd, follow_as=g.follower.owner,
    )  # fmt: skip
    if created.existing:
        return created.job_id, None, None
    return created.job_id, placed.handed_off, created.record


def _respond(g: Generation, body: Body, jobs: list[PromptJob], kind: str) -> AnswerResponse | StreamingResponse:
    s = g.services
    headers = {"X-Prfaas-Job-Id": ",".join(job.job_id for job in jobs)}
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        continuous = include_usage and bool(body.stream_options and body.stream_options.continuous_usage_stats)
        return ClosingStreamingResponse(
            sse(s, g.follower, jobs, kind, include_usage, continuous),
            gone=lambda: client_gone(g.follower, jobs, reading=True),  # its stream is read meanwhile
            unstarted=lambda: _unstarted(g, jobs),  # gone before its first chunk was asked for
            keepalive_s=s.settings.sse_keepalive_s,
            media_type="text/event-stream",
            headers=headers | {"Cache-Control": "no-cache"},
        )
    return AnswerResponse(lambda: _answer(g, jobs, kind), lambda: client_gone(g.follower, jobs, reading=True), headers)


def _unstarted(g: Generation, jobs: list[PromptJob]) -> None:
    """The client of a `stream=true` response left before its first chunk was asked for: its jobs end, and the
    streams nothing will read are closed: a batch's, and an attached request's (it stops counting as a reader of
    its job); a single job's own is `Follower.disconnected`'s."""
    try:
        client_gone(g.follower, jobs)
    finally:
        for job in jobs:
            if len(jobs) > 1 or not job.leader:
                close = getattr(job.stream, "close", None)
                if close is not None:
                    close()


def _answer(g: Generation, jobs: list[PromptJob], kind: str) -> dict[str, Any]:
    """The `stream=false` body, once every job of the request has ended (on a worker thread: api/unary.py)."""
    try:
        if len(jobs) == 1:
            _fill(jobs[0])
        else:  # the prompts' jobs run side by side; the first to fail cancels the others (they then end soon)
            with ThreadPoolExecutor(len(jobs), thread_name_prefix="prfaas-batch") as pool:
                futures = [pool.submit(_fill, job) for job in jobs]
                done, _ = wait(futures, return_when=FIRST_EXCEPTION)
                failed = [f for f in futures if f in done and f.exception() is not None]
                if failed:  # its error is the answer's, not the cancel it causes in the other prompts
                    cancel_batch(g.follower, jobs, "another prompt of the request failed")
                    failed[0].result()
                for future in futures:
                    future.result()
    except JobEnded as exc:
        cancel_batch(g.follower, jobs, "another prompt of the request failed")
        raise ended_error(exc) from None
    return {
        "id": jobs[0].job_id, "object": kind, "created": int(time.time()), "model": g.services.model.name,
        "choices": [choice.full() for job in jobs for choice in job.choices],
        "usage": usage(sum(j.prompt_tokens for j in jobs), completion_tokens(jobs)),
    }  # fmt: skip


def _fill(job: PromptJob) -> None:
    for token in job.stream:
        job.add(token)
