"""Errors of the HTTP API. Under `/v1` every 4xx and 5xx has OpenAI's shape, so the official clients raise
their typed errors (`openai.RateLimitError` for 429, ...) with `.type`, `.code` and `.param` set:

    {"error": {"message": "rate limit exceeded", "type": "rate_limit_error", "param": null,
               "code": "rate_limit_exceeded"}}

The `/admin` routes and the dashboard keep FastAPI's `{"detail": message}` (same messages). Routes raise
`Problem`s of the catalogue below (`raise RATE_LIMITED.error()`); `install(app)` renders them, FastAPI's
own errors (an unknown route, a pydantic validation error: 400 with the field in `param`, as vLLM's OpenAI
server does), a Redis or database outage (503 with Retry-After) and anything unexpected (500). A streamed
response that fails after its first byte sends the same object as an SSE line (`sse_error`). Messages are
stable: clients may match on `code`."""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import kombu.exceptions
import redis
import sqlalchemy.exc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

log = logging.getLogger(__name__)
OPENAI_PREFIX = "/v1"
VLLM_ROUTES = ("/tokenize", "/detokenize")  # vLLM's server extras (api/extras.py): OpenAI-shaped errors too
# OpenAI's error type by status (`type_of`): of a catalogue entry that names none, of a framework error, of an
# admin route's detail
TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 402: "insufficient_quota", 403: "permission_error",
    404: "not_found_error", 405: "invalid_request_error", 409: "conflict_error", 413: "invalid_request_error",
    422: "invalid_request_error", 429: "rate_limit_error",
}  # fmt: skip


class ApiError(StarletteHTTPException):
    """An HTTP error with OpenAI's fields. `detail` is the message (what `/admin` routes show)."""

    def __init__(
        self,
        status_code: int,
        message: str,
        type: str,
        code: str | None,
        *,
        param: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(status_code, message, dict(headers) if headers else None)
        self.message, self.type, self.code, self.param = message, type, code, param


@dataclass(frozen=True)
class Problem:
    """One entry of the catalogue: status, type, code and the stable message."""

    status: int
    type: str
    code: str | None
    message: str
    headers: tuple[tuple[str, str], ...] = ()

    def error(self, message: str | None = None, *, param: str | None = None) -> ApiError:
        """The exception to raise; `message` replaces the stable one only where it adds a detail."""
        return ApiError(
            self.status, message or self.message, self.type, self.code, param=param, headers=dict(self.headers)
        )


def type_of(status: int) -> str:
    """OpenAI's error type for an HTTP status: its `TYPES` entry, else `server_error` (5xx) or
    `invalid_request_error`."""
    return TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")


def problem(status: int, code: str | None, message: str, *, type: str | None = None, **headers: str) -> Problem:
    """A catalogue entry; `type` defaults to the status's (`type_of`), a header's `_` stands for `-`."""
    header_items = tuple((k.replace("_", "-"), v) for k, v in headers.items())
    return Problem(status, type or type_of(status), code, message, header_items)


_BEARER = {"WWW_Authenticate": "Bearer"}
INVALID_REQUEST = problem(400, "invalid_request", "invalid request")
PROMPT_EMPTY = problem(400, "empty_prompt", "prompt is empty")
PROMPT_TOO_LONG = problem(400, "context_length_exceeded", "prompt too long for the model")
TOKEN_OUT_OF_VOCAB = problem(400, "invalid_token_id", "prompt token id out of the model's vocabulary")
UNSUPPORTED_PARAMETER = problem(400, "unsupported_parameter", "parameter not supported")
INVALID_RANGE = problem(400, "invalid_range", "invalid range")
BATCH_TOO_LARGE = problem(400, "batch_too_large", "batch too large for the tenant's limits")
UNKNOWN_KV_CODEC = problem(400, "unknown_kv_codec", "kv_codec is neither lossless nor a lossy codec of the policy")
MISSING_API_KEY = problem(401, "missing_api_key", "missing API key", **_BEARER)
INVALID_API_KEY = problem(401, "invalid_api_key", "invalid API key", **_BEARER)
BUDGET_EXHAUSTED = problem(402, "budget_exhausted", "monthly budget exhausted")
TENANT_SUSPENDED = problem(403, "tenant_suspended", "tenant suspended")
ADMIN_REQUIRED = problem(403, "admin_key_required", "admin key required")
PLACEMENT_NOT_ALLOWED = problem(403, "placement_not_allowed", "placement requests are not enabled for this tenant")
MODEL_NOT_FOUND = problem(404, "model_not_found", "model not found")


def model_not_found(asked: str, served: str) -> ApiError:
    """404 `model_not_found`, naming the model asked for and the one served (the stable message first)."""
    return MODEL_NOT_FOUND.error(f"model not found: {asked!r}; this deployment serves {served!r}", param="model")


JOB_NOT_FOUND = problem(404, "job_not_found", "job not found")
USAGE_NOT_FOUND = problem(404, "usage_entry_not_found", "usage entry not found")
UNKNOWN_URL = problem(404, "unknown_url", "unknown URL", type="invalid_request_error")  # as OpenAI answers it
METHOD_NOT_ALLOWED = problem(405, "method_not_allowed", "method not allowed")
JOB_CANCELED = problem(409, "job_canceled", "job canceled")
JOB_FINISHED = problem(409, "job_finished", "job finished elsewhere")
BODY_TOO_LARGE = problem(413, "request_too_large", "request body too large")
IDEMPOTENCY_KEY_REUSED = problem(
    422, "idempotency_key_reused", "Idempotency-Key already used with a different request body"
)
RATE_LIMITED = problem(429, "rate_limit_exceeded", "rate limit exceeded", Retry_After="1")
TOO_MANY_JOBS = problem(429, "concurrency_limit_exceeded", "too many concurrent jobs", Retry_After="1")
INTERNAL = problem(500, "internal_error", "internal server error")
JOB_FAILED = problem(503, "job_failed", "job failed")
STORE_UNAVAILABLE = problem(  # Redis unreachable: the client retries after a moment
    503, "store_unavailable", "job store unavailable", Retry_After="2"
)
DATABASE_UNAVAILABLE = problem(  # the tenants' and ledger's database unreachable
    503, "database_unavailable", "database unavailable", Retry_After="2"
)
SHUTTING_DOWN = problem(  # this API process drains (api/shutdown.py): another one answers the retry
    503, "server_shutting_down", "server shutting down", Retry_After="1"
)
JOB_TIMEOUT = problem(504, "job_timeout", "job timeout")

ADMISSION_REFUSALS = {
    "rate": RATE_LIMITED, "concurrency": TOO_MANY_JOBS, "budget": BUDGET_EXHAUSTED,
    "idempotency": IDEMPOTENCY_KEY_REUSED,
}  # fmt: skip
JOB_ENDED = {"FAILED": JOB_FAILED, "CANCELED": JOB_CANCELED, "TIMEOUT": JOB_TIMEOUT, "DONE": JOB_FINISHED}


def error_object(exc: ApiError) -> dict[str, Any]:
    """OpenAI's error object: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": exc.message, "type": exc.type, "param": exc.param, "code": exc.code}}


def sse_error(exc: ApiError) -> str:
    """The error as a server-sent event, for a stream that fails after it started."""
    return f"data: {json.dumps(error_object(exc))}\n\n"


def _openai(request: Request) -> bool:
    path = request.url.path
    return path == OPENAI_PREFIX or path.startswith(OPENAI_PREFIX + "/") or path in VLLM_ROUTES


def render(request: Request, exc: ApiError) -> Response:
    """OpenAI's shape under /v1, FastAPI's `{"detail"}` elsewhere."""
    if _openai(request):
        return JSONResponse(error_object(exc), exc.status_code, headers=exc.headers)
    return JSONResponse({"detail": exc.detail}, exc.status_code, headers=exc.headers)


def _from_http(request: Request, exc: StarletteHTTPException) -> ApiError:
    """An HTTPException raised by the framework (routing) or a route that raised a bare one."""
    if isinstance(exc, ApiError):
        return exc
    if exc.status_code == 404 and exc.detail == "Not Found":
        return UNKNOWN_URL.error(f"unknown URL: {request.method} {request.url.path}")
    if exc.status_code == 405:
        return METHOD_NOT_ALLOWED.error(f"method not allowed: {request.method} {request.url.path}")
    if exc.status_code == 400:  # FastAPI's own, a body it cannot parse (bad UTF-8, too deep, a 5,000-digit number)
        return INVALID_REQUEST.error(f"invalid request: body: {exc.detail}")
    return ApiError(exc.status_code, str(exc.detail), type_of(exc.status_code), None, headers=exc.headers)


def _union_member(part: str) -> bool:
    """A pydantic location part naming which member of a union failed (`str`, `constrained-str`,
    `list[int]`, one of our schemas' class names: /tokenize's body), not a field: the `param` names fields only
    (`prompt`, `messages.0.role`)."""
    return (
        any(c in part for c in "[-")
        or part in ("str", "int", "float", "bool", "list", "dict", "none")
        or part in _schema_names()
    )


@functools.cache
def _schema_names() -> frozenset[str]:
    """The class names of the API's request schemas (what pydantic names a union's model members by)."""
    found, todo = set(), list(BaseModel.__subclasses__())
    while todo:
        klass = todo.pop()
        todo.extend(klass.__subclasses__())
        if klass.__module__.startswith("prfaas.control_plane.api."):
            found.add(klass.__name__)
    return frozenset(found)


def _telling(errors: list[dict[str, Any]]) -> dict[str, Any]:
    """The error to report: the first, or of a union (one error per member: `stop` is a string or a list),
    the first of the same field that is not "not of this member's type" (`stop: [17 strings]` is too long a
    list, not "Input should be a valid string"); when every member's is, the first (`prompt: ["a", 5]`)."""
    if not errors:
        return {}
    field = tuple(errors[0].get("loc", ()))[:2]
    same = [e for e in errors if tuple(e.get("loc", ()))[:2] == field]
    wrong_member = ("_type", "_parsing")  # a member of the wrong type, or a value it cannot parse as one
    return next((e for e in same if not str(e.get("type", "")).endswith(wrong_member)), errors[0])


def _invalid(request: Request, exc: RequestValidationError) -> Response:
    first = _telling(list(exc.errors()))
    loc = [str(p) for p in first.get("loc", ())]
    why = first.get("msg", "invalid")
    if not _openai(request):  # the admin routes keep FastAPI's 422
        return JSONResponse({"detail": f"invalid request: {'.'.join(p for p in loc if p != 'body')}: {why}"}, 422)
    if first.get("type") == "json_invalid":
        return render(request, INVALID_REQUEST.error(f"invalid request: body: {why}"))
    param = ".".join(p for p in loc[1:] if not _union_member(p)) or None  # loc[0]: "body" (or "query")
    if first.get("type") in ("extra_forbidden", "none_required") and param:  # unknown, or known and not implemented
        message = f"unsupported parameter: {param} (docs/control-plane.md lists the parameters this API honours)"
        return render(request, UNSUPPORTED_PARAMETER.error(message, param=param))
    return render(request, INVALID_REQUEST.error(f"invalid request: {param or 'body'}: {why}", param=param))


def install(app: FastAPI) -> None:
    """Register the handlers that render every error of `app` (see the module docstring)."""

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code in (204, 304):  # FastAPI's own rule: no body
            return Response(status_code=exc.status_code, headers=exc.headers)
        return render(request, _from_http(request, exc))

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> Response:
        return _invalid(request, exc)

    @app.exception_handler(redis.RedisError)
    async def store_down(request: Request, _exc: redis.RedisError) -> Response:
        return render(request, STORE_UNAVAILABLE.error())

    @app.exception_handler(kombu.exceptions.OperationalError)
    async def broker_down(request: Request, exc: kombu.exceptions.OperationalError) -> Response:
        log.warning("broker unreachable: %s", exc)
        return render(request, STORE_UNAVAILABLE.error())

    @app.exception_handler(sqlalchemy.exc.OperationalError)
    async def database_down(request: Request, exc: sqlalchemy.exc.OperationalError) -> Response:
        log.warning("database unreachable: %s", exc.orig)
        return render(request, DATABASE_UNAVAILABLE.error())

    @app.exception_handler(sqlalchemy.exc.TimeoutError)
    async def database_busy(request: Request, exc: sqlalchemy.exc.TimeoutError) -> Response:  # the pool ran dry
        log.warning("no database connection free: %s", exc)
        return render(request, DATABASE_UNAVAILABLE.error())

    @app.exception_handler(sqlalchemy.exc.DataError)
    async def unstorable(request: Request, exc: sqlalchemy.exc.DataError) -> Response:  # a NUL byte in PostgreSQL text
        log.info("database refused a value: %s", exc.orig)
        return render(request, INVALID_REQUEST.error("invalid request: a value the database cannot hold"))

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception) -> Response:  # Starlette logs it and re-raises
        return render(request, INTERNAL.error())
