"""OpenAI-compatible routes: `/v1/completions`, `/v1/chat/completions` (the model's chat
template), `stream=true` as server-sent events, `usage`, `/v1/models`.

Admission, cheapest first, so that a refused request costs no tokenizer time: model known (404),
`max_tokens` within limits and a token-id prompt within the vocabulary and the context (400),
placement allowed for the tenant (403); then one Redis step (`JobStore.admit`): Idempotency-Key (a
replay answers from its job; the key with another body: 422), budget headroom (402), concurrency
(429) and rate (429). Only then is the prompt tokenized and checked (400; the admission's slot and
rate count are given back), the job placed, its predicted $ reserved in the budget (402 when it does
not fit) and the job written (`JobStore.create`). The job is then queued for dispatch and its tokens
streamed back here. Error bodies: api/errors.py."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import secrets
import time
from collections.abc import Callable, Generator, Iterator
from typing import Any

import kombu.exceptions
import redis
from fastapi import APIRouter
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.types import Receive, Scope, Send

from prfaas.control_plane.api.deps import Generation, GenerationDep, ServicesDep, TenantDep
from prfaas.control_plane.api.errors import (
    ADMISSION_REFUSALS,
    JOB_ENDED,
    JOB_NOT_FOUND,
    MODEL_NOT_FOUND,
    PLACEMENT_NOT_ALLOWED,
    PROMPT_EMPTY,
    PROMPT_TOO_LONG,
    STORE_UNAVAILABLE,
    TOKEN_OUT_OF_VOCAB,
    ApiError,
    sse_error,
)
from prfaas.control_plane.api.schemas import ChatCompletionCreate, CompletionCreate
from prfaas.control_plane.jobs.celery_app import enqueue
from prfaas.control_plane.jobs.errors import AdmissionRefused, JobNotFound
from prfaas.control_plane.jobs.generation import Follower, JobEnded, Token
from prfaas.control_plane.jobs.store import Admission, HandedOff
from prfaas.control_plane.services import ServedModel, Services

log = logging.getLogger(__name__)
router = APIRouter(prefix="/v1", tags=["openai"])
Prompt = list[int] | Callable[[], list[int]]  # token ids, or how to tokenize the prompt (after admission)


@router.get("/models")
def list_models(_tenant: TenantDep, s: ServicesDep) -> dict[str, Any]:
    return {"object": "list", "data": [{"id": s.model.name, "object": "model", "created": 0, "owned_by": "prfaas"}]}


@router.post("/completions", response_model=None)
def create_completion(body: CompletionCreate, g: GenerationDep) -> JSONResponse | StreamingResponse:
    model = _served_model(g.services, body.model)
    if isinstance(body.prompt, list):
        ids = list(body.prompt)
        if max(ids) >= len(model.tokenizer):
            raise TOKEN_OUT_OF_VOCAB.error(param="prompt")
        return _run(g, body, ids, body.max_tokens, "text_completion")
    text = body.prompt
    return _run(g, body, lambda: model.encode(text), body.max_tokens, "text_completion")


@router.post("/chat/completions", response_model=None)
def create_chat_completion(body: ChatCompletionCreate, g: GenerationDep) -> JSONResponse | StreamingResponse:
    model = _served_model(g.services, body.model)
    messages = [m.model_dump() for m in body.messages]
    return _run(
        g, body, lambda: model.encode_chat(messages), body.max_completion_tokens or body.max_tokens, "chat.completion"
    )


def _served_model(s: Services, model: str) -> ServedModel:
    if model != s.model.name:
        raise MODEL_NOT_FOUND.error(param="model")
    return s.model


def _param(kind: str) -> str:
    return "messages" if kind == "chat.completion" else "prompt"


def _body_hash(g: Generation, body: CompletionCreate | ChatCompletionCreate, kind: str) -> str:
    """SHA-256 of the request as the API reads it (route, placement header, the body's fields in schema
    order with defaults filled in): what an Idempotency-Key is bound to."""
    canonical = f"{kind}\n{g.placement or ''}\n{body.model_dump_json()}"
    return hashlib.sha256(canonical.encode()).hexdigest()


def _refused(g: Generation, exc: AdmissionRefused) -> ApiError:
    g.metrics.refused.labels(exc.reason).inc()
    return ADMISSION_REFUSALS[exc.reason].error()


def _run(
    g: Generation, body: CompletionCreate | ChatCompletionCreate, prompt: Prompt, max_tokens: int | None, kind: str
) -> JSONResponse | StreamingResponse:
    s, tenant = g.services, g.tenant
    max_new = max_tokens or s.settings.default_max_tokens
    if max_new > s.settings.max_new_tokens_limit:
        raise PROMPT_TOO_LONG.error(param="max_tokens")
    if isinstance(prompt, list) and len(prompt) + max_new > s.model.max_context:
        raise PROMPT_TOO_LONG.error(param=_param(kind))
    placement = g.placement or (body.prfaas.placement if body.prfaas else "auto")
    if placement != "auto" and not tenant.allow_placement:
        raise PLACEMENT_NOT_ALLOWED.error(param="prfaas.placement")
    body_hash = _body_hash(g, body, kind) if g.idempotency_key else ""
    try:
        admission = s.jobs.admit(tenant.id, tenant.quota, idempotency_key=g.idempotency_key, body_hash=body_hash)
    except AdmissionRefused as exc:
        raise _refused(g, exc) from None
    if admission.existing:
        return _replay(g, body, admission.job_id, kind)
    try:  # from here on, a refusal gives the admission's slot and rate count back
        ids = prompt if isinstance(prompt, list) else g.metrics.tokenize(prompt)
        job_id, handed_off, record = _create(g, body, admission, ids, max_new, placement, kind)
    except AdmissionRefused as exc:
        s.jobs.release(admission)
        raise _refused(g, exc) from None
    except BaseException:
        s.jobs.release(admission)
        raise
    if record is None:  # a concurrent request with the same Idempotency-Key and body created the job
        return _replay(g, body, job_id, kind)
    ready: dict[str, Any] | None = None
    if handed_off is not None:
        ready = {"attempt": 1} | handed_off.ready
    else:
        try:
            enqueue(g.follower.celery, job_id)
        except kombu.exceptions.OperationalError:  # the broker (Redis) is away: the job never runs
            g.follower.abandon(job_id, "broker unreachable at dispatch")
            raise STORE_UNAVAILABLE.error() from None
        record = None
    return _respond(g, body, job_id, kind, len(ids), record, ready)


def _create(
    g: Generation,
    body: CompletionCreate | ChatCompletionCreate,
    admission: Admission,
    ids: list[int],
    max_new: int,
    placement: str,
    kind: str,
) -> tuple[str, HandedOff | None, dict[str, str] | None]:
    """Check the tokenized prompt, place the job, reserve its predicted $ and write it: (job id, its
    hand-off when placed locally at admission, its record; None when another request's job answers)."""
    s, tenant = g.services, g.tenant
    if not ids:
        raise PROMPT_EMPTY.error(param=_param(kind))
    if len(ids) + max_new > s.model.max_context:
        raise PROMPT_TOO_LONG.error(param=_param(kind))
    seed = body.seed if body.seed is not None or body.temperature == 0 else secrets.randbits(62)
    fields: dict[str, Any] = {
        "model": s.model.name, "kind": kind, "token_ids": ids, "prompt_tokens": len(ids), "max_new_tokens": max_new,
        "temperature": body.temperature, "placement_asked": placement,
    }  # fmt: skip
    if seed is not None:
        fields["seed"] = seed
    if g.idempotency_key:  # a retry can attach to it: adopted if its API process dies (jobs/sweeper.py)
        fields["idempotent"] = 1
    asked = {"id": admission.job_id, "tenant": tenant.id, "prompt_tokens": str(len(ids))}
    asked |= {"max_new_tokens": str(max_new), "placement_asked": placement}  # not the prompt: str() of 100k ids
    placed = g.follower.placer.place(asked, hand_off=s.settings.admission_placement)
    created = s.jobs.create(
        tenant.id, fields | placed.fields, tenant.quota, handed_off=placed.handed_off, admission=admission,
        reserve_usd=placed.predicted_usd,
    )  # fmt: skip
    if created.existing:
        return created.job_id, None, None
    return created.job_id, placed.handed_off, created.record


def _replay(
    g: Generation, body: CompletionCreate | ChatCompletionCreate, job_id: str, kind: str
) -> JSONResponse | StreamingResponse:
    """The answer to a request whose Idempotency-Key (and body) an earlier request used: that job's."""
    s = g.services
    try:
        job = s.jobs.get(job_id)
    except JobNotFound:
        raise JOB_NOT_FOUND.error() from None
    prompt = int(job.get("prompt_tokens", 0) or 0)
    if not body.stream and job["state"] == "DONE" and job.get("output_ids"):  # the same answer, not a new run
        output = json.loads(job["output_ids"])
        reply = _full(s, job_id, kind, output, job.get("finish_reason", "length"), prompt)
        return JSONResponse(reply, headers={"X-Prfaas-Job-Id": job_id})
    return _respond(g, body, job_id, kind, prompt, None, None, attach=True)  # never a second run


def _respond(
    g: Generation,
    body: CompletionCreate | ChatCompletionCreate,
    job_id: str,
    kind: str,
    prompt: int,
    record: dict[str, str] | None,
    ready: dict[str, Any] | None,
    *,
    attach: bool = False,
) -> JSONResponse | StreamingResponse:
    """`attach`: the job is another request's (the same Idempotency-Key): read its token log
    (jobs/tokenlog.py) rather than follow it."""
    s, follower = g.services, g.follower
    stream = follower.attached(job_id) if attach else follower.tokens(job_id, record, ready)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    if body.stream:
        return ClosingStreamingResponse(
            _sse(s, stream, follower, job_id, kind, prompt, include_usage, leader=not attach),
            media_type="text/event-stream",
            headers={"X-Prfaas-Job-Id": job_id, "Cache-Control": "no-cache"},
        )
    tokens: list[int] = []
    finish = "length"
    try:
        for token in stream:
            tokens.append(token.token)
            finish = token.finish_reason or finish
    except JobEnded as exc:
        raise _ended(exc) from None
    return JSONResponse(_full(s, job_id, kind, tokens, finish, prompt), headers={"X-Prfaas-Job-Id": job_id})


def _ended(exc: JobEnded) -> ApiError:
    return JOB_ENDED[exc.state].error(f"job {exc.state.lower()}: {exc}")


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _full(s: Services, job_id: str, kind: str, tokens: list[int], finish: str, prompt: int) -> dict[str, Any]:
    text = s.model.decode(tokens)
    choice: dict[str, Any] = {"index": 0, "finish_reason": _finish(finish), "logprobs": None}
    if kind == "chat.completion":
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    return {
        "id": job_id, "object": kind, "created": int(time.time()), "model": s.model.name, "choices": [choice],
        "usage": _usage(prompt, len(tokens)),
    }  # fmt: skip


def _finish(reason: str) -> str:
    return "stop" if reason == "eos" else "length"


class ClosingStreamingResponse(StreamingResponse):
    """Closes its generator as soon as the response ends, however it ends. On a client
    disconnect Starlette just stops iterating; the generator's `finally` (which cancels the job
    in both regions) would otherwise run only when the garbage collector reaches it, seconds
    later, while the decode region keeps generating."""

    def __init__(self, content: Generator[str, None, None], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self.source = content

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await run_in_threadpool(self.source.close)  # no-op when it ran to its end
            except ValueError:  # a next() still in flight (Starlette waits for it; defensive): GC closes it
                log.warning("stream generator still running at disconnect; its job is canceled later")


def _sse(
    s: Services,
    stream: Iterator[Token],
    follower: Follower,
    job_id: str,
    kind: str,
    prompt: int,
    include_usage: bool,
    *,
    leader: bool,
) -> Generator[str, None, None]:
    """`leader`: this request's stream is the job's own (its follower); else attached to it."""
    chat = kind == "chat.completion"
    obj = "chat.completion.chunk" if chat else "text_completion"
    created = int(time.time())

    def chunk(choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> str:
        payload: dict[str, Any] = {"id": job_id, "object": obj, "created": created, "model": s.model.name}
        payload["choices"] = choices
        if usage is not None:
            payload["usage"] = usage
        return f"data: {json.dumps(payload)}\n\n"

    tokens: list[int] = []
    text = ""
    finished = False
    try:
        if chat:
            yield chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])
        for token in stream:
            tokens.append(token.token)
            full = s.model.decode(tokens)
            piece = ""
            # hold back a partial UTF-8 character (decoded as U+FFFD) until its next token completes it
            if full.startswith(text) and (token.last or not full.endswith("\ufffd")):
                piece, text = full[len(text) :], full
            finish = _finish(token.finish_reason) if token.last else None
            body = {"delta": {"content": piece}} if chat else {"text": piece}
            yield chunk([{"index": 0, **body, "finish_reason": finish, "logprobs": None}])
        finished = True
        if include_usage:
            yield chunk([], _usage(prompt, len(tokens)))
        yield "data: [DONE]\n\n"
    except JobEnded as exc:
        finished = True
        yield sse_error(_ended(exc))
    except redis.RedisError:  # a read outside the follower (it turns its own into JobEnded)
        finished = True
        yield sse_error(STORE_UNAVAILABLE.error())
    finally:
        if not finished and leader:  # the client went away mid-stream
            with contextlib.suppress(redis.RedisError):  # then its job ends with the outage (Follower.abandon)
                follower.disconnected(job_id, stream)
