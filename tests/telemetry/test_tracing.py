"""Tracing in one process with the SDK's real provider and the span-file exporter: contexts carried as
traceparent strings and gRPC metadata, server streams ended with their spans, the span files read back as a
job's tree; and the KV shipment's OPEN carrying the sender's context to the receiver."""

from __future__ import annotations

import gc
import json
import time
from collections.abc import Generator
from pathlib import Path

import pytest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from prfaas.telemetry import tracing
from prfaas.telemetry.spans import JsonLinesExporter, job_trace, read_spans, tree
from prfaas.transport.codecs import CodecId
from prfaas.transport.errors import FrameError
from prfaas.transport.open_info import OpenInfo


@pytest.fixture
def recorded(tmp_path: Path) -> tuple[tracing.trace.Tracer, Path]:  # type: ignore[name-defined]
    """A tracer of its own (the global provider is set once per process) writing to a span file."""
    provider = TracerProvider(resource=Resource.create({"service.name": "unit"}))
    provider.add_span_processor(SimpleSpanProcessor(JsonLinesExporter(tmp_path / "unit-1.jsonl")))
    return provider.get_tracer("test"), tmp_path


def test_off_without_an_exporter_and_its_spans_carry_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (tracing.TRACE_DIR_ENV, *tracing.OTLP_ENVS):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(tracing, "_configured", None)
    assert tracing.configure("nothing") is False
    span = tracing.tracer.start_span("x")
    assert (tracing.traceparent(span), tracing.metadata(span)) == ("", ())
    assert tracing.from_traceparent("") is None and tracing.from_metadata([("other", "1")]) is None


def test_a_context_crosses_as_traceparent_and_metadata_and_the_files_read_back_as_a_tree(recorded, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    tracer, folder = recorded
    monkeypatch.setattr(tracing, "tracer", tracer)  # span_at's
    root = tracer.start_span("api.job", attributes={tracing.JOB_ID: "job-1"})
    parent = tracing.traceparent(root)
    assert len(parent) == 55 and parent.startswith("00-")
    # another process: the worker, from the job's record
    dispatch = tracer.start_span("worker.dispatch", context=tracing.from_traceparent(parent))
    call = tracer.start_span("worker.prefill", context=tracing.set_span_in_context(dispatch))
    metadata = tracing.metadata(call)
    assert [key for key, _ in metadata] == ["traceparent"]
    # the callee, from its invocation metadata (bytes values arrive as well)
    received = [(key, str(value).encode()) for key, value in metadata]
    served = tracer.start_span("prefill.job", context=tracing.from_metadata(received))
    now = time.time_ns()
    tracing.span_at("prefill.forward", served, now, now + 5_000_000, {"prfaas.cached_tokens": 0})
    for span in (served, call, dispatch):
        span.end()
    tracing.end(root, RuntimeError("client went away"))
    other = tracer.start_span("api.job", attributes={tracing.JOB_ID: "job-2"})  # another trace: not in job-1's
    other.end()

    spans = job_trace(folder, "job-1")
    assert [s.name for s in spans] == ["api.job", "worker.dispatch", "worker.prefill", "prefill.job", "prefill.forward"]
    assert {s.trace_id for s in spans} == {spans[0].trace_id} and spans[0].status == "error: client went away"
    (top,) = tree(spans)
    assert [(depth, s.name) for depth, s in top.walk()] == [
        (0, "api.job"), (1, "worker.dispatch"), (2, "worker.prefill"), (3, "prefill.job"), (4, "prefill.forward")
    ]  # fmt: skip
    forward = spans[-1]
    assert forward.service == "unit" and forward.ms == pytest.approx(5.0)
    assert job_trace(folder, "no-such-job") == []


def test_a_span_file_cut_short_mid_line_loses_only_that_line(tmp_path: Path) -> None:
    line = {"trace_id": "a" * 32, "span_id": "b" * 16, "parent_id": "", "name": "api.job", "service": "api",
            "start_ns": 1, "end_ns": 2, "status": "ok", "attributes": {tracing.JOB_ID: "j"}}  # fmt: skip
    (tmp_path / "api-1.jsonl").write_text(json.dumps(line) + "\n" + json.dumps(line)[:40])
    assert [s.name for s in read_spans(tmp_path)] == ["api.job"]


def test_traced_ends_its_span_with_the_stream_closes_it_and_marks_only_errors(recorded, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    tracer, folder = recorded
    monkeypatch.setattr(tracing, "tracer", tracer)
    closed: list[bool] = []

    def events() -> Generator[int, None, None]:
        try:
            yield from range(10)
        finally:
            closed.append(True)

    stream = tracing.traced("decode.job", [], "job-3", events())
    assert [next(stream), next(stream)] == [0, 1]
    stream.close()  # the caller went away after two events
    assert closed == [True]
    (span,) = job_trace(folder, "job-3")  # a reader that stops early is not an error
    assert (span.name, span.attributes["prfaas.events"], span.status) == ("decode.job", 2, "ok")
    assert span.attributes["prfaas.closed_early"] is True

    def failing() -> Generator[int, None, None]:
        yield 1
        raise RuntimeError("engine died")

    with pytest.raises(RuntimeError):
        list(tracing.traced("decode.job", [], "job-4", failing()))
    (span,) = job_trace(folder, "job-4")
    assert span.status == "error: engine died" and span.attributes["prfaas.events"] == 1


def test_a_spanned_stream_ends_its_span_however_it_ends_read_or_not(recorded) -> None:  # type: ignore[no-untyped-def]
    """A generator's `finally` never runs for one closed or dropped before its first item (a batch's later prompt
    refused, a client gone before the first chunk): `Spanned` ends its span then too, once."""
    tracer, folder = recorded
    closed: list[str] = []

    def span(name: str) -> tracing.Span:
        return tracer.start_span("api.job", attributes={tracing.JOB_ID: name})

    def items(name: str) -> Generator[int, None, None]:
        try:
            yield from range(3)
        finally:
            closed.append(name)

    def failing() -> Generator[int, None, None]:
        yield 1
        raise RuntimeError("engine died")

    read = tracing.Spanned(span("read"), items("read"))
    assert list(read) == [0, 1, 2]
    read.close()  # once ended, a close ends nothing twice
    tracing.Spanned(span("closed"), items("closed")).close()  # before its first item
    tracing.Spanned(span("refused"), items("refused")).close("another prompt of the request was refused")
    started = tracing.Spanned(span("started"), items("started"))
    assert next(started) == 0
    started.close()  # mid-stream: the items are closed too
    with pytest.raises(RuntimeError):
        list(tracing.Spanned(span("failed"), failing()))
    dropped = tracing.Spanned(span("dropped"), items("dropped"))
    del dropped  # never read nor closed: ended when collected
    gc.collect()

    ended = [
        (s.attributes[tracing.JOB_ID], s.status, s.attributes.get("prfaas.closed_early")) for s in read_spans(folder)
    ]
    assert sorted(ended) == [
        ("closed", "ok", True), ("dropped", "ok", True), ("failed", "error: engine died", None), ("read", "ok", None),
        ("refused", "error: another prompt of the request was refused", None), ("started", "ok", True),
    ]  # fmt: skip
    assert sorted(closed) == ["read", "started"]  # a generator that never started has no `finally` to run


def test_a_span_at_carries_its_parents_job_id_and_ending_marks_an_escaping_error(recorded, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    tracer, folder = recorded
    monkeypatch.setattr(tracing, "tracer", tracer)
    now = time.time_ns()
    dispatch = tracer.start_span("worker.dispatch", attributes={tracing.JOB_ID: "job-5"})

    def attempt() -> None:
        with tracing.ending(dispatch) as parent:
            tracing.span_at("worker.placement", parent, now, now + 1000)  # its parent's job id, unless told one
            tracing.span_at("prefill.queue", parent, now, now + 1000, {"prfaas.cached_tokens": 0})
            raise KeyError("a bug")

    with pytest.raises(KeyError):
        attempt()
    spans = {s.name: s for s in job_trace(folder, "job-5")}
    assert {name: s.attributes.get(tracing.JOB_ID) for name, s in spans.items()} == {
        "worker.dispatch": "job-5", "worker.placement": "job-5", "prefill.queue": "job-5"
    }  # fmt: skip
    assert spans["worker.dispatch"].status == "error: 'a bug'" and spans["worker.placement"].status == "ok"


def test_the_open_frame_carries_the_senders_context_and_refuses_a_malformed_one() -> None:
    info = OpenInfo("bfloat16", ((2, 4, 8),), int(CodecId.RAW), 4096, "00-" + "1" * 32 + "-" + "2" * 16 + "-01")
    parsed, ticket = OpenInfo.from_json(json.loads(json.dumps(info.to_json("t"))))
    assert (parsed.traceparent, ticket) == (info.traceparent, "t")
    assert parsed == OpenInfo("bfloat16", ((2, 4, 8),), int(CodecId.RAW), 4096)  # not part of the shipment's identity
    plain = OpenInfo("bfloat16", ((2, 4, 8),), int(CodecId.RAW), 4096).to_json("t")
    assert "traceparent" not in plain and OpenInfo.from_json(plain)[0].traceparent == ""  # as peers before it send
    with pytest.raises(FrameError, match="traceparent"):
        OpenInfo.from_json(plain | {"traceparent": "x" * 200})
    with pytest.raises(FrameError, match="traceparent"):
        OpenInfo.from_json(plain | {"traceparent": 7})
