"""Tracing: one OpenTelemetry trace per job, across the API, the Celery worker, the prefill and the decode
regions, and the KV transfer between them.

A process calls `configure(service)` once at start. What it exports is set by the environment, the same in
every process of a deployment:

- `OTEL_EXPORTER_OTLP_ENDPOINT` (or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`): spans go to that collector by
  OTLP/HTTP, batched on a thread of the SDK's (the exporter reads the standard `OTEL_EXPORTER_OTLP_*` options).
- `PRFAAS_TRACE_DIR`: spans are also written to `DIR/SERVICE-PID.jsonl` (telemetry/spans.py), which is what
  `prfaas trace JOB_ID` reads; `prfaas up` sets it to `$PRFAAS_HOME/up/traces`.
- neither: no provider is installed and every span is OpenTelemetry's no-op (about a microsecond).

How the context travels (W3C `traceparent`): in the job's record in Redis (field `trace`, written by the API
with the job, so the worker that dispatches it, or retries it, continues the same trace); in gRPC metadata on
every call to a region (`metadata()` on the client, `from_metadata()` in the servicer); and in the KV
shipment's OPEN frame (docs/wire-format.md), so the decode region's receive span is a child of the prefill
region's. Spans are named `stage` or `service.stage`, carry `prfaas.job_id` (a `span_at` child its parent's)
and, where they have one, the region, mode and codec (attributes `prfaas.*`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import weakref
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, Generic, TypeVar

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, set_span_in_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import AttributeValue

log = logging.getLogger(__name__)
TRACE_DIR_ENV = "PRFAAS_TRACE_DIR"
OTLP_ENVS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
TRACEPARENT = "traceparent"
FLUSH_EVERY_MS = 200  # the file exporter's batch delay: `prfaas trace` sees a job's spans this soon after it ends
JOB_ID = "prfaas.job_id"

T = TypeVar("T")
StreamMethod = Callable[[Any, Any, Any], Generator[Any, None, None]]
_propagator = TraceContextTextMapPropagator()
_configured: str | None = None
_lock = threading.Lock()
tracer = trace.get_tracer("prfaas")

__all__ = [
    "JOB_ID",
    "Span",
    "SpanKind",
    "Spanned",
    "configure",
    "end",
    "ending",
    "failed",
    "from_metadata",
    "from_traceparent",
    "interrupted",
    "metadata",
    "server_stream",
    "set_span_in_context",
    "span_at",
    "traced",
    "traceparent",
    "traceparent_in",
    "tracer",
]  # fmt: skip


def configure(service: str, attributes: dict[str, str] | None = None) -> bool:
    """Install this process's tracer provider, once, as the environment says (the module docstring); the
    service name is `service`. Returns whether spans are exported at all."""
    global _configured
    with _lock:
        if _configured is not None:
            return _configured != ""
        endpoint = next((os.environ[e] for e in OTLP_ENVS if os.environ.get(e)), "")
        folder = os.environ.get(TRACE_DIR_ENV, "")
        if not endpoint and not folder:
            _configured = ""
            return False
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        from prfaas.telemetry.spans import JsonLinesExporter

        provider = TracerProvider(resource=Resource.create({"service.name": service} | (attributes or {})))
        if endpoint:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        if folder:
            path = Path(folder) / f"{service}-{os.getpid()}.jsonl"
            files = JsonLinesExporter(path)
            provider.add_span_processor(BatchSpanProcessor(files, schedule_delay_millis=FLUSH_EVERY_MS))
        trace.set_tracer_provider(provider)
        _configured = service
        where = [f"OTLP {endpoint}"] * bool(endpoint) + [f"files in {folder}"] * bool(folder)
        log.info("tracing on as %s: %s", service, ", ".join(where))
        return True


def traceparent(span: Span) -> str:
    """`span`'s W3C traceparent ("" when it is not recording: tracing off)."""
    carrier: dict[str, str] = {}
    _propagator.inject(carrier, set_span_in_context(span))
    return carrier.get(TRACEPARENT, "")


def from_traceparent(value: str | None) -> otel_context.Context | None:
    """The context a `traceparent` names (None when empty: a span started with it is a root)."""
    if not value:
        return None
    return _propagator.extract({TRACEPARENT: value})


def metadata(span: Span) -> tuple[tuple[str, str | bytes], ...]:
    """gRPC metadata carrying `span` as the callee's parent (empty when tracing is off)."""
    value = traceparent(span)
    return ((TRACEPARENT, value),) if value else ()


def traceparent_in(pairs: Iterable[tuple[str, str | bytes]] | None) -> str:
    """The traceparent a caller sent in gRPC metadata (`context.invocation_metadata()`; "" for none)."""
    for key, value in pairs or ():
        if key == TRACEPARENT:
            return value.decode() if isinstance(value, bytes) else value
    return ""


def from_metadata(pairs: Iterable[tuple[str, str | bytes]] | None) -> otel_context.Context | None:
    """The parent a caller sent in gRPC metadata (`context.invocation_metadata()`)."""
    return from_traceparent(traceparent_in(pairs))


def server_stream(name: str) -> Callable[[StreamMethod], StreamMethod]:
    """A gRPC servicer's stream method under `traced(name, ...)`: the request's `job_id`, the call's metadata."""

    def decorate(method: StreamMethod) -> StreamMethod:
        @functools.wraps(method)
        def wrapper(self: Any, request: Any, context: Any) -> Generator[Any, None, None]:
            yield from traced(name, context.invocation_metadata(), request.job_id, method(self, request, context))

        return wrapper

    return decorate


def traced(name: str, pairs: Iterable[tuple[str, str | bytes]] | None, job_id: str,
           events: Generator[T, None, None]) -> Iterator[T]:  # fmt: skip
    """A server stream's `events` under a span of the caller's trace (from its metadata `pairs`), ended with
    them (attribute `prfaas.events`: how many were sent); closes `events` however the stream ends (the caller
    gone: the work stops now, as `yield from` would)."""
    span = tracer.start_span(name, context=from_metadata(pairs), kind=SpanKind.SERVER, attributes={JOB_ID: job_id})
    sent = 0
    try:
        for event in events:
            sent += 1
            yield event
    except BaseException as exc:
        interrupted(span, exc)
        raise
    finally:
        events.close()
        span.set_attribute("prfaas.events", sent)
        span.end()


class Spanned(Generic[T]):
    """`items` under `span`, which ends with them however the stream ends: read to its end, raised (an error),
    closed by its reader (`prfaas.closed_early`; `close(error)`: failed instead), or dropped unclosed (ended
    when collected). Before its first item too, unlike a generator's `finally`, which never runs for a
    generator closed or dropped before it started: its span would never be exported."""

    def __init__(self, span: Span, items: Iterator[T]) -> None:
        self.span = span
        self.items = items
        self._dropped = weakref.finalize(self, _dropped, span)  # detached once the span ends here

    def __iter__(self) -> Spanned[T]:
        return self

    def __next__(self) -> T:
        try:
            return next(self.items)
        except StopIteration:
            self._end(None)
            raise
        except BaseException as exc:
            self._end(exc)
            raise

    def close(self, error: str | None = None) -> None:
        """Stop reading: `items` closed, the span ended (failed with `error` when given, else closed early)."""
        try:
            close = getattr(self.items, "close", None)
            if close is not None:
                close()
        except BaseException as exc:
            self._end(exc)
            raise
        self._end(error if error is not None else GeneratorExit())

    def _end(self, error: BaseException | str | None) -> None:
        if self._dropped.detach() is None:  # ended already
            return
        if isinstance(error, BaseException):
            interrupted(self.span, error)
        elif error is not None:
            failed(self.span, error)
        self.span.end()


def _dropped(span: Span) -> None:
    span.set_attribute("prfaas.closed_early", True)
    span.end()


def span_at(name: str, parent: otel_context.Context | Span | None, start_ns: int, end_ns: int,
            attributes: Mapping[str, AttributeValue] | None = None) -> None:  # fmt: skip
    """A finished span of measured times (ns since the epoch), child of `parent` (a context or a span), whose
    `prfaas.job_id` it carries unless `attributes` name one."""
    if isinstance(parent, Span):
        job_id = (getattr(parent, "attributes", None) or {}).get(JOB_ID)  # an SDK span's (none when off)
        attributes = ({JOB_ID: job_id} | dict(attributes or {})) if job_id is not None else attributes
        parent = set_span_in_context(parent)
    span = tracer.start_span(name, context=parent, start_time=start_ns, attributes=attributes)
    span.end(end_time=max(start_ns, end_ns))


def failed(span: Span, error: BaseException | str) -> None:
    """Mark `span` as ended in error (it is ended by whoever started it)."""
    span.set_status(Status(StatusCode.ERROR, str(error) or type(error).__name__))


def interrupted(span: Span, exc: BaseException) -> None:
    """A stream's span whose stream ended by `exc`: an error, or (GeneratorExit) closed by its reader, which
    is not one: a caller may stop reading once it has what it needs (attribute `prfaas.closed_early`)."""
    if isinstance(exc, GeneratorExit):
        span.set_attribute("prfaas.closed_early", True)
    else:
        failed(span, exc)


@contextlib.contextmanager
def ending(span: Span) -> Iterator[Span]:
    """`span`, ended when the block exits; an exception that escapes the block marks it (`interrupted`) and
    goes on: a span its own code ends is never exported "ok" for an error nobody expected."""
    try:
        yield span
    except BaseException as exc:
        interrupted(span, exc)
        raise
    finally:
        span.end()


def end(span: Span, error: BaseException | str | None = None) -> None:
    """End `span`, marked as an error when `error` is given."""
    if error is not None:
        failed(span, error)
    span.end()
