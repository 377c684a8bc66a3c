"""`prfaas trace` takes the 8-character job id the dashboard's "Recent jobs" shows (or any longer start of
one): before, `prfaas trace e332a3ca` answered "no spans of job e332a3ca". A start shared by several jobs is
refused naming them; a start shorter than 8 characters is no job's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from prfaas.telemetry.tracing import JOB_ID

PRFAAS = [sys.executable, "-m", "prfaas.cli.main"]
JOBS = {  # job id -> its trace
    "e332a3ca-0b5f-4c1e-9d7a-1f2e3d4c5b6a": "a" * 32,
    "7f00aa11-1111-4000-8000-000000000001": "b" * 32,
    "7f00aa11-2222-4000-8000-000000000002": "c" * 32,
}


@pytest.fixture
def spans(tmp_path: Path) -> Path:
    """A span folder as `prfaas up` leaves it: per job, its API span (with the job id) and a child without."""
    lines = []
    for i, (job, trace) in enumerate(JOBS.items()):
        lines.append({"trace_id": trace, "span_id": f"{i:016x}", "parent_id": "", "name": "api.job",
                      "service": "prfaas-api", "start_ns": 1_000, "end_ns": 9_000_000, "status": "ok",
                      "attributes": {JOB_ID: job}})  # fmt: skip
        lines.append({"trace_id": trace, "span_id": f"{i + 100:016x}", "parent_id": f"{i:016x}",
                      "name": "prefill.forward", "service": "prfaas-region-pre", "start_ns": 2_000,
                      "end_ns": 5_000_000, "status": "ok", "attributes": {}})  # fmt: skip
    (tmp_path / "prfaas-api-1.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return tmp_path


def _trace(job: str, folder: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run([*PRFAAS, "trace", job, "--dir", str(folder), "--json"], env=env, capture_output=True,
                          text=True, timeout=60, check=False)  # fmt: skip


def test_the_dashboards_short_id_finds_the_job(spans: Path) -> None:
    for given in ("e332a3ca", "e332a3ca-0b5f", "e332a3ca-0b5f-4c1e-9d7a-1f2e3d4c5b6a"):
        done = _trace(given, spans)
        assert done.returncode == 0, done.stdout + done.stderr
        shown = json.loads(done.stdout)
        assert [(s["name"], s["trace_id"]) for s in shown] == [("api.job", "a" * 32), ("prefill.forward", "a" * 32)]
        assert shown[0]["attributes"][JOB_ID] == "e332a3ca-0b5f-4c1e-9d7a-1f2e3d4c5b6a"


def test_a_start_of_several_jobs_ids_is_refused_naming_them(spans: Path) -> None:
    done = _trace("7f00aa11", spans)
    assert done.returncode == 2
    assert done.stdout.strip() == (
        "error: 7f00aa11 is the start of 2 jobs' ids (7f00aa11-1111-4000-8000-000000000001, "
        "7f00aa11-2222-4000-8000-000000000002): give more of it"
    )
    assert _trace("7f00aa11-2222", spans).returncode == 0


def test_a_start_shorter_than_the_dashboards_is_no_job(spans: Path) -> None:
    done = _trace("e332a3c", spans)
    assert done.returncode == 1 and done.stdout.startswith("error: no spans of job e332a3c in "), done.stdout
