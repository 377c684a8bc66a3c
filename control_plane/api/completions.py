"""OpenAI-compatible routes: `/v1/completions`, `/v1/chat/completions` (the model's chat
template), `stream=true` as server-sent events, `usage`, `/v1/models`.

Admission, in order: model known (404), prompt fits the model (400), placement allowed for
the tenant (403), then in one Redis step idempotency, budget (402), concurrency (429) and
rate (429). The job is then queued for dispatch and its tokens streamed back here."""

from __future__ import annotations

import json
import logging
import secrets
import time
import uuid
from collections.abc import Generator, Iterator
from typing import Any

from fastapi import APIRouter, HTTPException
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.types import Receive, Scope, Send

from prfaas.control_plane.api.deps import Generation, GenerationDep, ServicesDep, TenantDep
from prfaas.control_plane.api.schemas import ChatCompletionCreate, CompletionCreate
from prfaas.control_plane.jobs.celery_app import enqueue
from prfaas.control_plane.jobs.errors import AdmissionRefused
from prfaas.control_plane.jobs.generation import Follower, JobEnded, Token
from prfaas.control_plane.services import ServedModel, Services

log = logging.getLogger(__name__)
router = APIRouter(prefix="/v1", tags=["openai"])
REFUSALS = {
    "rate": (429, "rate limit exceeded"),
    "concurrency": (429, "too many concurrent jobs"),
    "budget": (402, "monthly budget exhausted"),
}
ENDED = {"FAILED": 503, "CANCELED": 409, "TIMEOUT": 504, "DONE": 409}


@router.get("/models")
def list_models(_tenant: TenantDep, s: ServicesDep) -> dict[str, Any]:
    return {"object": "list", "data": [{"id": s.model.name, "object": "model", "created": 0, "owned_by": "prfaas"}]}


@router.post("/completions", response_model=None)
def create_completion(body: CompletionCreate, g: GenerationDep) -> JSONResponse | StreamingResponse:
    model = _served_model(g.services, body.model)
    ids = list(body.prompt) if isinstance(body.prompt, list) else model.encode(body.prompt)
    if isinstance(body.prompt, list) and max(ids) >= len(model.tokenizer):
        raise HTTPException(400, "prompt token id out of the model's vocabulary")
    return _run(g, body, ids, body.max_tokens, "text_completion")


@router.post("/chat/completions", response_model=None)
def create_chat_completion(body: ChatCompletionCreate, g: GenerationDep) -> JSONResponse | StreamingResponse:
    ids = _served_model(g.services, body.model).encode_chat([m.model_dump() for m in body.messages])
    return _run(g, body, ids, body.max_completion_tokens or body.max_tokens, "chat.completion")


def _served_model(s: Services, model: str) -> ServedModel:
    if model != s.model.name:
        raise HTTPException(404, "model not found")
    return s.model


def _run(
    g: Generation, body: CompletionCreate | ChatCompletionCreate, ids: list[int], max_tokens: int | None, kind: str
) -> JSONResponse | StreamingResponse:
    s, follower, tenant, idempotency_key = g.services, g.follower, g.tenant, g.idempotency_key
    settings = s.settings
    max_new = max_tokens or settings.default_max_tokens
    if not ids:
        raise HTTPException(400, "prompt is empty")
    if max_new > settings.max_new_tokens_limit or len(ids) + max_new > s.model.max_context:
        raise HTTPException(400, "prompt too long for the model")
    placement = g.placement or (body.prfaas.placement if body.prfaas else "auto")
    if placement != "auto" and not tenant.allow_placement:
        raise HTTPException(403, "placement requests are not enabled for this tenant")
    seed = body.seed if body.seed is not None or body.temperature == 0 else secrets.randbits(62)
    fields: dict[str, Any] = {
        "model": s.model.name, "kind": kind, "token_ids": ids, "prompt_tokens": len(ids), "max_new_tokens": max_new,
        "temperature": body.temperature, "placement_asked": placement,
    }  # fmt: skip
    if seed is not None:
        fields["seed"] = seed
    job_id = str(uuid.uuid4())
    placed = None
    if s.settings.admission_placement:
        asked = {"id": job_id, "tenant": tenant.id, "prompt_tokens": str(len(ids)), "max_new_tokens": str(max_new)}
        placed = follower.placer.place(asked | {"placement_asked": placement})  # not the prompt: str() of 100k ids
    handed_off = placed[0] if placed else None
    if placed:
        fields |= placed[1]
    try:
        created = s.jobs.create(tenant.id, fields, tenant.quota, idempotency_key, handed_off, job_id=job_id)
    except AdmissionRefused as exc:
        status, detail = REFUSALS[exc.reason]
        raise HTTPException(status, detail) from None
    job_id = created.job_id
    if created.existing:  # the same Idempotency-Key again: the first request's job, never a second run
        job = s.jobs.get(job_id)
        if not body.stream and job["state"] == "DONE" and job.get("output_ids"):
            output = json.loads(job["output_ids"])
            return JSONResponse(_full(s, job_id, kind, output, job.get("finish_reason", "length"), len(ids)))
        stream, leader = follower.attached(job_id), False  # its tokens as its follower logs them
    elif handed_off is not None:
        stream, leader = follower.tokens(job_id, created.record, {"attempt": 1} | handed_off.ready), True
    else:
        enqueue(follower.celery, job_id)
        stream, leader = follower.tokens(job_id), True
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    if body.stream:
        return ClosingStreamingResponse(
            _sse(s, stream, follower, job_id, kind, len(ids), include_usage, leader),
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
        raise HTTPException(ENDED[exc.state], f"job {exc.state.lower()}: {exc}") from None
    return JSONResponse(_full(s, job_id, kind, tokens, finish, len(ids)), headers={"X-Prfaas-Job-Id": job_id})


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
        yield f"data: {json.dumps({'error': {'message': f'job {exc.state.lower()}: {exc}', 'code': exc.state}})}\n\n"
    finally:
        if not finished and leader:  # the client went away mid-stream
            follower.disconnected(job_id, stream)
