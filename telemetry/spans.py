"""Spans on local disk, for `prfaas trace JOB_ID` on a deployment without a collector (`prfaas up`): each
process appends its finished spans to `DIR/SERVICE-PID.jsonl`, one JSON object per line; `job_trace` reads
every file of DIR back and returns the spans of the trace a job's spans belong to, which `tree` orders as the
parent/child tree. A line is {trace_id, span_id, parent_id (hex, "" for a root), name, service, start_ns,
end_ns, status ("ok" | "error: ..."), attributes}."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.trace import StatusCode

from prfaas.telemetry.tracing import JOB_ID


class JsonLinesExporter(SpanExporter):
    """Appends each finished span to one file (this process's own: no two writers share it)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        path.parent.mkdir(parents=True, exist_ok=True)

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = "".join(json.dumps(_line(span), separators=(",", ":")) + "\n" for span in spans)
        try:
            with self._lock, self.path.open("a") as out:
                out.write(lines)
        except OSError:
            return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass


def _line(span: ReadableSpan) -> dict[str, Any]:
    context, parent = span.get_span_context(), span.parent
    assert context is not None  # a finished span of the SDK has one
    status = "ok" if span.status.status_code is not StatusCode.ERROR else f"error: {span.status.description or ''}"
    return {
        "trace_id": f"{context.trace_id:032x}", "span_id": f"{context.span_id:016x}",
        "parent_id": f"{parent.span_id:016x}" if parent is not None else "", "name": span.name,
        "service": str(span.resource.attributes.get("service.name", "")), "start_ns": span.start_time or 0,
        "end_ns": span.end_time or 0, "status": status,
        "attributes": {k: v if isinstance(v, str | int | float | bool) else list(v)  # type: ignore[arg-type]
                       for k, v in (span.attributes or {}).items()},
    }  # fmt: skip


@dataclass
class SpanLine:
    """One span as `JsonLinesExporter` wrote it, and its children once `tree` ran."""

    trace_id: str
    span_id: str
    parent_id: str
    name: str
    service: str
    start_ns: int
    end_ns: int
    status: str
    attributes: dict[str, Any]
    children: list[SpanLine] = field(default_factory=list)

    @property
    def ms(self) -> float:
        return (self.end_ns - self.start_ns) / 1e6

    def walk(self, depth: int = 0) -> Iterator[tuple[int, SpanLine]]:
        """(depth, span) of this span and every descendant, parents first, siblings by start."""
        yield depth, self
        for child in self.children:
            yield from child.walk(depth + 1)


_FIELD_TYPES: dict[str, type] = {
    "trace_id": str, "span_id": str, "parent_id": str, "name": str, "service": str,
    "start_ns": int, "end_ns": int, "status": str, "attributes": dict,
}  # fmt: skip


def _span_line(text: str) -> SpanLine | None:
    """The span of one line, or None when it is not one `JsonLinesExporter` could have written: not JSON
    (cut short mid-write), other keys, or a value of another type (a bool is no count of nanoseconds)."""
    try:
        doc = json.loads(text)
    except ValueError:
        return None
    if not isinstance(doc, dict) or doc.keys() != _FIELD_TYPES.keys():
        return None
    for key, kind in _FIELD_TYPES.items():
        value = doc[key]
        if not isinstance(value, kind) or isinstance(value, bool):
            return None
    return SpanLine(**doc)


def read_spans(folder: Path) -> list[SpanLine]:
    """Every span in `folder`'s files; a line that is not a span (cut short by a process that died mid-write,
    or a value of the wrong type) is skipped, so one bad line never hides the others."""
    spans: list[SpanLine] = []
    for path in sorted(folder.glob("*.jsonl")):
        for text in path.read_text(errors="replace").splitlines():
            span = _span_line(text)
            if span is not None:
                spans.append(span)
    return spans


def job_trace(folder: Path, job_id: str) -> list[SpanLine]:
    """The spans of the trace that `job_id`'s spans are in, by start time (empty: none recorded)."""
    spans = read_spans(folder)
    traces = {s.trace_id for s in spans if s.attributes.get(JOB_ID) == job_id}
    return sorted((s for s in spans if s.trace_id in traces), key=lambda s: s.start_ns)


def tree(spans: list[SpanLine]) -> list[SpanLine]:
    """The roots of `spans` with their children filled in, by start time. A span whose parent was not
    recorded (its process exports elsewhere, or died) is shown as a root."""
    by_id = {s.span_id: s for s in spans}
    for span in spans:  # a span's children are those of this call's spans only
        span.children = []
    roots: list[SpanLine] = []
    for span in sorted(spans, key=lambda s: s.start_ns):
        parent = by_id.get(span.parent_id)
        (parent.children if parent is not None else roots).append(span)
    return roots
