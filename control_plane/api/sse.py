"""A prompt's job as the completion routes hold it (`PromptJob`), and the `stream=true` response: server-sent
events, one chunk per token as vLLM sends them (text "" while it is held back), the usage chunk when asked,
`[DONE]`; a job that ends without its tokens ends the stream with an error event (api/errors.py)."""

from __future__ import annotations

import contextlib
import inspect
import json
import logging
import math
import time
from collections.abc import AsyncIterator, Callable, Generator, Iterator
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.to_thread
import redis
from fastapi.responses import StreamingResponse
from starlette.types import Message, Receive, Scope, Send

from prfaas.control_plane.api import threads
from prfaas.control_plane.api.choices import Choice, usage
from prfaas.control_plane.api.errors import JOB_ENDED, STORE_UNAVAILABLE, ApiError, sse_error
from prfaas.control_plane.api.errors import SHUTTING_DOWN as SHUTTING_DOWN_ERROR
from prfaas.control_plane.api.streams import merged
from prfaas.control_plane.jobs.errors import JobEnded
from prfaas.control_plane.jobs.generation import Follower
from prfaas.control_plane.jobs.store import CLIENT_LEFT, SHUTTING_DOWN
from prfaas.control_plane.jobs.tokenlog import Token
from prfaas.control_plane.services import Services

log = logging.getLogger(__name__)
KEEPALIVE = ": keep-alive\n\n"  # an SSE comment: clients (the openai SDKs among them) skip it


@dataclass
class PromptJob:
    """One prompt's job, started (or found again by its Idempotency-Key), and the choices it fills."""

    job_id: str
    stream: Iterator[Token]
    prompt_tokens: int
    choices: list[Choice]  # the job's n choices
    leader: bool  # its stream is this request's own (not attached to another request's job)

    def add(self, token: Token) -> Choice:
        """Give `token` to its choice; the prompt's logprobs (on the job's first token) go to every choice, as
        vLLM echoes them in each."""
        if token.prompt_logprobs:
            for choice in self.choices:
                choice.prompt_logprobs = token.prompt_logprobs
        choice = self.choices[token.choice]
        choice.add(token)
        return choice


def completion_tokens(jobs: list[PromptJob]) -> int:
    return sum(len(choice.tokens) for job in jobs for choice in job.choices)


def ended_error(exc: JobEnded) -> ApiError:
    """`job canceled: <reason>` (a canceled job's error reads `canceled: <reason>`: said once); a job canceled
    as its API process shut down is that process's 503 (api/shutdown.py), which a client retries."""
    state = exc.state.lower()
    if exc.state == "CANCELED" and str(exc) == f"canceled: {SHUTTING_DOWN}":
        return SHUTTING_DOWN_ERROR.error()
    return JOB_ENDED[exc.state].error(f"job {state}: {str(exc).removeprefix(state + ': ')}")


class _ClientGone(Exception):
    """`send` failed: the client is gone."""


class _SourceFailed(Exception):
    """The generator raised (its error is raised after the response's task group): the response is not ended
    as if complete, so its client sees a broken stream, not a short one."""


class ClosingStreamingResponse(StreamingResponse):
    """Streams `content`'s chunks, each `next()` on a waiting thread (api/threads.py), while the client is
    listened to. A client that goes away calls `gone` at once (on a thread of its own): the request's jobs end,
    and a `next()` waiting for their next token returns soon, as vLLM aborts a request whose client left.
    (Starlette's own listener cannot stop a `next()` in flight: a client gone before the first token left the
    prefill, the KV shipment and the decode running for no one until that token came.) The generator is closed
    as soon as the response ends, however it ends, so its `finally` runs then, not when the garbage collector
    reaches it; one that never started has no `finally` to run: `unstarted` is called instead. A stream with
    nothing to send for `keepalive_s` (a job queued behind a busy fleet, a long prefill) gets an SSE comment,
    which clients skip, so a proxy's idle timeout does not cut it."""

    def __init__(self, content: Generator[str, None, None], *, gone: Callable[[], None],
                 unstarted: Callable[[], None], keepalive_s: float = 0.0, **kwargs: Any) -> None:  # fmt: skip
        super().__init__(content, **kwargs)
        self.source = content
        self.gone = gone
        self.unstarted = unstarted
        self.keepalive_s = keepalive_s or math.inf

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        waiting, source = threads.waiting(scope), self.source
        ended = False  # the generator's last chunk was read: a client that leaves now left nothing running
        error: Exception | None = None
        # the generator is read one chunk ahead of the client, so a wait for it can be interrupted by a keep-alive
        ahead, behind = anyio.create_memory_object_stream[str](0)

        async def read() -> None:
            nonlocal ended, error
            try:
                async with ahead:
                    while (chunk := await anyio.to_thread.run_sync(next, source, None, limiter=waiting)) is not None:
                        await ahead.send(chunk)
                    ended = True
            except Exception as exc:  # the generator's own: raised after the group, not in an ExceptionGroup
                error = exc
                group.cancel_scope.cancel()

        async def chunks() -> AsyncIterator[str]:
            group.start_soon(read)  # once the first chunk is asked for (the headers went out)
            async with behind:
                while True:
                    chunk = KEEPALIVE
                    with anyio.move_on_after(self.keepalive_s):
                        try:
                            chunk = await behind.receive()
                        except anyio.EndOfStream:
                            if error is not None:
                                raise _SourceFailed from None
                            return
                    yield chunk

        async def listen() -> None:
            while (await receive())["type"] != "http.disconnect":  # the body was read: only its end can come
                pass
            if not ended:
                try:
                    await anyio.to_thread.run_sync(self.gone, limiter=threads.gone())
                except Exception:  # the generator's `finally` ends the jobs all the same
                    log.exception("ending the jobs of a client gone")
            group.cancel_scope.cancel()  # a `next()` in flight returns first (a thread is not cancelled)

        async def sending(message: Message) -> None:
            try:
                await send(message)
            except OSError:  # the client is gone (ASGI 2.4 servers raise it from `send`)
                raise _ClientGone from None

        self.body_iterator = chunks()
        try:
            async with anyio.create_task_group() as group:
                group.start_soon(listen)
                with contextlib.suppress(_ClientGone, _SourceFailed):
                    await self.stream_response(sending)
                group.cancel_scope.cancel()
            if error is not None:
                raise error
        finally:
            if inspect.getgeneratorstate(self.source) == inspect.GEN_CREATED:
                await anyio.to_thread.run_sync(self.unstarted, limiter=threads.gone())
            try:
                await anyio.to_thread.run_sync(self.source.close, limiter=threads.gone())  # no-op once it ended
            except ValueError:  # a next() still in flight (defensive: the group waited for it): GC closes it
                log.warning("stream generator still running at disconnect; its job is canceled later")


def sse(
    s: Services, follower: Follower, jobs: list[PromptJob], kind: str, include_usage: bool, continuous: bool = False
) -> Generator[str, None, None]:
    """`continuous`: vLLM's `continuous_usage_stats`, usage on every chunk too (its prompt's tokens and its
    choice's so far, as vLLM counts them)."""
    chat = kind == "chat.completion"
    obj = "chat.completion.chunk" if chat else "text_completion"
    created = int(time.time())
    job_id = jobs[0].job_id

    def chunk(choices: list[dict[str, Any]], usage_: dict[str, int] | None = None) -> str:
        payload: dict[str, Any] = {"id": job_id, "object": obj, "created": created, "model": s.model.name}
        payload["choices"] = choices
        if usage_ is not None:
            payload["usage"] = usage_
        return f"data: {json.dumps(payload)}\n\n"

    finished = False
    stream: Iterator[tuple[int, Token]] = (
        ((0, token) for token in jobs[0].stream) if len(jobs) == 1 else merged([job.stream for job in jobs])
    )
    role = {"delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
    roles_due = chat  # a chunk per choice with its role, sent with the first token as vLLM sends them (so a
    # client's time to first chunk is its time to first token, not to its admission)
    try:
        for index, token in stream:
            if roles_due:
                roles_due = False
                for c in jobs[0].choices:  # a chat is one prompt
                    yield chunk([{"index": c.index} | role], usage(jobs[0].prompt_tokens, 0) if continuous else None)
            choice = jobs[index].add(token)
            piece = choice.chunk()
            if piece is not None:
                yield chunk([piece], usage(jobs[index].prompt_tokens, len(choice.tokens)) if continuous else None)
        finished = True
        if include_usage:
            yield chunk([], usage(sum(j.prompt_tokens for j in jobs), completion_tokens(jobs)))
        yield "data: [DONE]\n\n"
    except JobEnded as exc:
        finished = True
        cancel_batch(follower, jobs, "another prompt of the request failed")  # the stream ends here for all
        yield sse_error(ended_error(exc))
        yield "data: [DONE]\n\n"  # after the error too, as vLLM ends every stream
    except redis.RedisError:  # a read outside the follower (it turns its own into JobEnded)
        finished = True
        cancel_batch(follower, jobs, "another prompt of the request failed")
        yield sse_error(STORE_UNAVAILABLE.error())
        yield "data: [DONE]\n\n"
    finally:
        close = getattr(stream, "close", None)
        if not finished:  # the client went away mid-stream
            client_gone(follower, jobs)
        if close is not None:
            close()
        if len(jobs) == 1 and not jobs[0].leader:  # an attached request's reader stops counting now, not at GC
            close = getattr(jobs[0].stream, "close", None)
            if close is not None:
                close()


def client_gone(follower: Follower, jobs: list[PromptJob], *, reading: bool = False) -> None:
    """The client of a request went away before its end: its own jobs are canceled in both regions (a single
    job read by requests attached to it is read to its end for them). `reading`: a thread is reading the jobs'
    streams (a `stream=false` answer being built), which then end with their jobs."""
    with contextlib.suppress(redis.RedisError):  # then its job ends with the outage (Follower.abandon)
        if len(jobs) == 1 and jobs[0].leader:
            if reading:
                follower.left(jobs[0].job_id)
            else:
                follower.disconnected(jobs[0].job_id, jobs[0].stream)
    cancel_batch(follower, jobs, CLIENT_LEFT, by_client=True)


def cancel_batch(follower: Follower, jobs: list[PromptJob], reason: str, *, by_client: bool = False) -> None:
    """A batch's response ended early (one prompt's job failed, or its client left): the jobs of its other
    prompts are canceled, not left running for no one, billed, and holding the tenant's concurrency slots.
    (A single job: its own end, or `client_gone`.) A job that has ended already is left as it is. `by_client`:
    its client left, so each job's tokens read so far are billed (`Follower.cancel`)."""
    for job in jobs if len(jobs) > 1 else ():
        if job.leader:
            with contextlib.suppress(redis.RedisError):  # then its job ends with the outage (Follower.abandon)
                follower.cancel(job.job_id, reason, by_client=by_client)
