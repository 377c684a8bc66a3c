"""Span files read back (telemetry/spans.py): a line no exporter wrote is skipped, never the whole trace."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from prfaas.telemetry.spans import job_trace, read_spans, tree
from prfaas.telemetry.tracing import JOB_ID

GOOD = {"trace_id": "a" * 32, "span_id": "b" * 16, "parent_id": "", "name": "api.job", "service": "api",
        "start_ns": 1, "end_ns": 2, "status": "ok", "attributes": {JOB_ID: "j1"}}  # fmt: skip


@pytest.mark.parametrize(
    "odd",
    [
        {"attributes": None},  # job_trace called None.get for every job
        {"attributes": ["x"]},
        {"start_ns": "3"},  # tree sorted str against int: TypeError
        {"end_ns": 4.5},
        {"start_ns": True},  # a bool is an int to Python, not a count of nanoseconds
        {"span_id": 7},
        {"parent_id": None},
        {"status": {"ok": True}},
    ],
)
def test_a_line_with_a_value_of_the_wrong_type_is_skipped(tmp_path: Path, odd: dict[str, Any]) -> None:
    bad = GOOD | {"span_id": "c" * 16, "trace_id": "d" * 32} | odd
    (tmp_path / "api-1.jsonl").write_text(json.dumps(GOOD) + "\n" + json.dumps(bad) + "\n")
    assert [s.span_id for s in read_spans(tmp_path)] == ["b" * 16]
    [root] = tree(job_trace(tmp_path, "j1"))
    assert root.name == "api.job" and root.ms == pytest.approx(1e-6)


@pytest.mark.parametrize("line", ['["a", "b"]', "42", '"text"', "null", json.dumps(GOOD | {"children": []})])
def test_a_line_that_is_not_a_span_object_is_skipped(tmp_path: Path, line: str) -> None:
    (tmp_path / "api-1.jsonl").write_text(line + "\n" + json.dumps(GOOD) + "\n")
    assert [s.name for s in read_spans(tmp_path)] == ["api.job"]
