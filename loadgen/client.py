"""The load generator behind `prfaas bench`: the official `openai` client, streaming, as a
tenant's program would call the API.

Open loop (`rate_rps`: each request starts at its planned time whatever the others do) or
closed loop (`concurrency` requests in flight). Per request: TTFT (send -> first streamed
token), inter-token gaps, end-to-end latency; then each job's placement, regions, KV bytes
and cost from `GET /v1/jobs/{id}`. Every call has a deadline (`timeout_s`). A request completed when
a token streamed and a chunk carried its `finish_reason` (a stream cut short fails; one cut after that
chunk, before the usage chunk or `[DONE]`, lost nothing). The connection pool has room for every request
in flight (open loop: no limit), so no request waits in the client for a connection with its clock running.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from prfaas.loadgen.conversations import THINK_S, Conversation
from prfaas.loadgen.workload import Planned

log = logging.getLogger(__name__)

PLACEMENTS = {  # --compare name -> API placement (control_plane/jobs/prefix.py for the blind ones)
    "colocated": "local", "split-always": "split", "prfaas": "auto",
    "prfaas-prefix-blind": "auto-prefix-blind", "prfaas-residency-blind": "auto-residency-blind",
}  # fmt: skip


@dataclass
class Outcome:
    """One request as the client saw it, plus the job's record."""

    index: int
    klass: str
    at_s: float
    prompt_tokens: int
    shared_prefix_tokens: int
    prefix_group: int | None
    max_tokens: int
    sent_s: float = 0.0  # from the run's start
    ttft_s: float | None = None
    latency_s: float | None = None
    output_tokens: int = 0
    itl_s: list[float] = field(default_factory=list)  # gaps between streamed chunks after the first
    ok: bool = False
    error: str | None = None
    job_id: str | None = None
    job: dict[str, Any] = field(default_factory=dict)
    usage: dict[str, Any] = field(default_factory=dict)  # the ledger's entry, when the API has one
    text: str = ""  # the reply, as streamed
    cache_salt: str = ""  # the run's prefix cache scope (each policy's run starts with cold caches)

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.latency_s is None or self.output_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)


async def _one(
    client: Any, model: str, req: Planned, placement: str, t0: float, timeout_s: float, salt: str
) -> Outcome:
    out = Outcome(req.index, req.klass, req.at_s, len(req.prompt), req.shared_prefix_tokens, req.prefix_group,
                  req.max_tokens, cache_salt=salt)  # fmt: skip
    await _send(client, model, list(req.prompt), placement, t0, timeout_s, out)
    return out


async def _send(
    client: Any, model: str, prompt: list[int], placement: str, t0: float, timeout_s: float, out: Outcome
) -> None:
    """One streamed completion of `prompt` (greedy), its figures and text written to `out`."""
    start = time.perf_counter()
    out.sent_s = start - t0
    last = seen = 0.0  # perf_counter of the last text chunk, of the last chunk
    pieces = 0
    finished = False  # a chunk carried a finish_reason: the reply is whole (not cut off by a stream's end)
    try:
        extra: dict[str, Any] = {"prfaas": {"placement": placement}}
        if out.cache_salt:
            extra["cache_salt"] = out.cache_salt
        async with asyncio.timeout(timeout_s):
            stream = await client.completions.create(
                model=model, prompt=prompt, max_tokens=out.max_tokens, stream=True, temperature=0.0,
                stream_options={"include_usage": True}, extra_body=extra,
            )  # fmt: skip
            async for chunk in stream:
                now = seen = time.perf_counter()
                out.job_id = out.job_id or chunk.id
                finished = finished or bool(chunk.choices and chunk.choices[0].finish_reason)
                if chunk.choices and chunk.choices[0].text:
                    out.text += chunk.choices[0].text
                    pieces += 1
                    if out.ttft_s is None:
                        out.ttft_s = now - start
                    else:
                        out.itl_s.append(now - last)
                    last = now
                if chunk.usage is not None:
                    out.output_tokens = chunk.usage.completion_tokens
        out.latency_s = time.perf_counter() - start
        out.output_tokens = out.output_tokens or pieces
        out.ok = out.ttft_s is not None and finished
        if out.ttft_s is None:
            out.error = "no token streamed"
        elif not finished:
            out.error = "stream ended without finish_reason"
    except TimeoutError:
        out.error = f"timeout after {timeout_s} s"
    except Exception as exc:  # an API error is a result of the run, not a crash of it
        out.error = f"{type(exc).__name__}: {str(exc)[:200]}"
    if out.latency_s is None and finished and out.ttft_s is not None:  # cut after the finish_reason: whole
        out.latency_s, out.ok, out.error = seen - start, True, None
        out.output_tokens = out.output_tokens or pieces


async def _run(
    api_base: str, api_key: str, model: str, planned: list[Planned], placement: str, concurrency: int | None,
    timeout_s: float, on_done: Callable[[Outcome], None], salt: str,
) -> tuple[list[Outcome], float]:  # fmt: skip
    import openai

    http = httpx.AsyncClient(limits=_limits(concurrency), timeout=httpx.Timeout(timeout_s, connect=10))
    client = openai.AsyncOpenAI(base_url=api_base, api_key=api_key, max_retries=0, http_client=http)
    t0 = time.perf_counter()
    outcomes: list[Outcome] = []

    async def fire(req: Planned) -> None:
        result = await _one(client, model, req, placement, t0, timeout_s, salt)
        outcomes.append(result)
        on_done(result)

    try:
        if concurrency is None:  # open loop: each request at its planned time
            tasks = []
            for req in planned:
                delay = req.at_s - (time.perf_counter() - t0)
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(fire(req)))
            await asyncio.gather(*tasks)
        else:
            queue = list(reversed(planned))

            async def worker() -> None:
                while queue:
                    await fire(queue.pop())

            await asyncio.gather(*(worker() for _ in range(min(concurrency, len(planned)))))
    finally:
        await client.close()
        await http.aclose()
    return sorted(outcomes, key=lambda o: o.index), time.perf_counter() - t0


def _limits(concurrency: int | None) -> httpx.Limits:
    """A connection for every request in flight: `concurrency` (closed loop), or as many as the open loop's
    arrivals ask for (a cap would queue them in the client, and their TTFT would count the wait)."""
    return httpx.Limits(max_connections=concurrency, max_keepalive_connections=256)


def run(
    api_base: str, api_key: str, model: str, planned: list[Planned], placement: str = "auto",
    concurrency: int | None = None, timeout_s: float = 300.0, on_done: Callable[[Outcome], None] = lambda _: None,
    cache_salt: str = "",
) -> tuple[list[Outcome], float]:  # fmt: skip
    """Send `planned` and return (outcomes in request order, wall seconds). `cache_salt` (vLLM's request
    parameter): the requests share cached prompt blocks only among themselves ("": with the tenant's others)."""
    return asyncio.run(_run(api_base, api_key, model, planned, placement, concurrency, timeout_s, on_done, cache_salt))


def run_conversations(
    api_base: str, api_key: str, model: str, conversations: list[Conversation], placement: str,
    concurrency: int | None, timeout_s: float, encode: Callable[[str], list[int]], max_prompt_tokens: int,
    think_s: float = THINK_S, on_done: Callable[[Outcome], None] = lambda _: None, cache_salt: str = "",
) -> tuple[list[Outcome], float]:  # fmt: skip
    """Each conversation turn by turn (`concurrency` conversations at once, or each from its start time):
    a turn's prompt is the history (system prompt, earlier turns and their replies as `encode` gives
    their text) and its user message. -> (outcomes by conversation and turn, wall seconds)."""
    return asyncio.run(_conversations(api_base, api_key, model, conversations, placement, concurrency, timeout_s,
                                      encode, max_prompt_tokens, think_s, on_done, cache_salt))  # fmt: skip


async def _conversations(
    api_base: str, api_key: str, model: str, conversations: list[Conversation], placement: str,
    concurrency: int | None, timeout_s: float, encode: Callable[[str], list[int]], max_prompt_tokens: int,
    think_s: float, on_done: Callable[[Outcome], None], salt: str,
) -> tuple[list[Outcome], float]:  # fmt: skip
    import openai

    http = httpx.AsyncClient(limits=_limits(concurrency), timeout=httpx.Timeout(timeout_s, connect=10))
    client = openai.AsyncOpenAI(base_url=api_base, api_key=api_key, max_retries=0, http_client=http)
    gate = asyncio.Semaphore(concurrency or len(conversations) or 1)
    t0 = time.perf_counter()
    outcomes: list[Outcome] = []
    turns = max((len(c.users) for c in conversations), default=1)

    def unsent(conv: Conversation, first: int, tokens: int, at_s: float, why: str) -> None:
        """Turns `first`.. that a conversation did not send count as failed (`why`), not as none: every planned
        turn is an outcome. Their prompts: at least the history so far (`tokens`) and the user messages up to
        theirs; their arrivals: `at_s` for turn `first`, then a pause apart."""
        for later in range(first, len(conv.users)):
            tokens += len(conv.users[later])
            arrival_s = at_s + think_s * (later - first)
            lost = Outcome(conv.index * turns + later, f"turn{later}", arrival_s, tokens, len(conv.system), conv.index,
                           conv.max_tokens[later], cache_salt=salt, error=why)  # fmt: skip
            outcomes.append(lost)
            on_done(lost)

    async def talk(conv: Conversation) -> None:
        delay = conv.start_s - (time.perf_counter() - t0)
        if delay > 0:
            await asyncio.sleep(delay)
        async with gate:
            history = list(conv.system)
            for turn, (user, limit) in enumerate(zip(conv.users, conv.max_tokens, strict=True)):
                prompt = history + list(user)
                # arrival: turn 0's is planned, a later turn's is when it was sent (after a reply and a pause)
                at_s = conv.start_s if turn == 0 else time.perf_counter() - t0
                if len(prompt) + limit > max_prompt_tokens:  # the conversation outgrew the model: it ends here
                    unsent(conv, turn, len(history), at_s, "not sent: the conversation outgrew the model's context")
                    return
                out = Outcome(conv.index * turns + turn, f"turn{turn}", at_s, len(prompt), len(conv.system),
                              conv.index, limit, cache_salt=salt)  # fmt: skip
                await _send(client, model, prompt, placement, t0, timeout_s, out)
                outcomes.append(out)
                on_done(out)
                if not out.ok:  # a failed turn ends the conversation (its history is unknown)
                    ended_s = time.perf_counter() - t0
                    why = f"not sent: turn {turn} of its conversation failed"
                    unsent(conv, turn + 1, len(prompt), ended_s + think_s, why)
                    return
                history = prompt + encode(out.text)
                if turn + 1 < len(conv.users):
                    await asyncio.sleep(think_s)

    try:
        await asyncio.gather(*(talk(c) for c in conversations))
    finally:
        await client.close()
        await http.aclose()
    return sorted(outcomes, key=lambda o: o.index), time.perf_counter() - t0


def attach_jobs(api_base: str, api_key: str, outcomes: list[Outcome], ledger_wait_s: float = 10.0) -> None:
    """Fill each outcome's `job` from GET /v1/jobs/{id} (placement, regions, bytes, cost) and,
    when the API has a ledger (GET /v1/usage/jobs/{id}), its `usage` entry. Entries are written
    off the request path, so a missing one is asked again until `ledger_wait_s` has passed. An API gone or
    answering nonsense meanwhile leaves the rest empty (the run's own figures are still written), with a warning."""
    try:
        _attach_jobs(api_base, api_key, outcomes, ledger_wait_s)
    except (httpx.HTTPError, ValueError) as exc:  # ValueError: a body that is not JSON
        log.warning("jobs and usage not read from the API (%s: %s); the report has the client's figures only",
                    type(exc).__name__, exc)  # fmt: skip


def _attach_jobs(api_base: str, api_key: str, outcomes: list[Outcome], ledger_wait_s: float) -> None:
    headers = {"Authorization": f"Bearer {api_key}"}
    done = [o for o in outcomes if o.job_id and o.ok]
    with httpx.Client(base_url=api_base, headers=headers, timeout=10) as http:
        for o in outcomes:
            if o.job_id:
                reply = http.get(f"/jobs/{o.job_id}")
                if reply.status_code == 200:
                    o.job = reply.json()
        if not done:
            return
        probe = http.get(f"/usage/jobs/{done[0].job_id}")
        if probe.status_code == 404 and _unknown_route(probe.json()):
            return  # no such route: this API has no ledger
        deadline = time.monotonic() + ledger_wait_s
        waiting = done
        while waiting and time.monotonic() < deadline:
            for o in waiting:
                reply = http.get(f"/usage/jobs/{o.job_id}")
                if reply.status_code == 200:
                    o.usage = reply.json()
            waiting = [o for o in waiting if not o.usage]
            if waiting:
                time.sleep(0.2)


def _unknown_route(body: dict[str, object]) -> bool:
    """A 404 for the route itself (OpenAI's error object; FastAPI's default before it), not for the entry."""
    error = body.get("error")
    return body.get("detail") == "Not Found" or (isinstance(error, dict) and error.get("code") == "unknown_url")


class ApiUnusable(Exception):
    """The API cannot be used as given (not reached, the key refused, no model served); one line that says which."""


def fetch_models(api_base: str, api_key: str) -> list[str]:
    """The models `api_base` serves (at least one), else ApiUnusable."""
    url = api_base + "/models"
    try:
        reply = httpx.get(url, headers={"Authorization": f"Bearer {api_key}"}, timeout=10)
    except httpx.InvalidURL as exc:
        raise ApiUnusable(f"{api_base!r} is not a URL the API can be reached at: {exc}") from None
    except httpx.HTTPError as exc:
        raise ApiUnusable(f"cannot reach {url}: {type(exc).__name__}: {exc}") from None
    if reply.status_code in (401, 403):
        raise ApiUnusable(f"{api_base} refused the API key (HTTP {reply.status_code}: {_message(reply)})")
    if reply.status_code != 200:
        raise ApiUnusable(f"{url} answered HTTP {reply.status_code}: {_message(reply)}")
    try:
        models = [str(m["id"]) for m in reply.json()["data"]]
    except (ValueError, KeyError, TypeError):
        raise ApiUnusable(f"{url} did not answer a model list (is {api_base} a prfaas API?)") from None
    if not models:
        raise ApiUnusable(f"{url} serves no model")
    return models


def _message(reply: httpx.Response) -> str:
    """The error message of an OpenAI-style error body, else the body's start, on one line."""
    try:
        error = reply.json().get("error")
        if isinstance(error, dict) and error.get("message"):
            return " ".join(str(error["message"]).split())[:200]
    except (ValueError, AttributeError):
        pass
    return " ".join(reply.text.split())[:200] or reply.reason_phrase
