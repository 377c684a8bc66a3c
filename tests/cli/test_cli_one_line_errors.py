"""An `error:` line of the CLI stays one line when its output is not a terminal (rich then wraps at 80
columns, or 150 for bench's console): before, a long path in it was split across two lines, and a log's
`grep error:` got half the message (docs/operations.md promises one line)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

PRFAAS = [sys.executable, "-m", "prfaas.cli.main"]


def _prfaas(args: list[str], home: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"} | {"PRFAAS_HOME": str(home)}
    return subprocess.run([*PRFAAS, *args], env=env, capture_output=True, text=True, timeout=120, check=False)


def _one_error(done: subprocess.CompletedProcess[str]) -> str:
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


def test_up_with_an_unknown_model_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "topology.yaml").write_text(yaml.safe_dump({
        "name": "f", "model": "llama-9000", "regions": [{"name": "dec", "role": "decode", "usd_per_gpu_hour": 4.0}],
    }))  # fmt: skip
    done = _prfaas(["up", "--detach", "--topology", str(tmp_path / "topology.yaml")], tmp_path / "home")
    assert done.returncode == 2
    assert _one_error(done) == (
        "error: topology 'f': model: 'llama-9000' is neither a catalog model (smollm2-135m, tiny-llama) nor a "
        "folder with a config.json"
    )


def test_model_prepare_of_an_unknown_model_is_one_line(tmp_path: Path) -> None:
    done = _prfaas(["model", "prepare", "llama-9000-with-a-name-long-enough-to-pass-eighty-columns"], tmp_path)
    assert done.returncode == 2
    assert _one_error(done).endswith("; available: smollm2-135m, tiny-llama")


def test_trace_without_spans_of_the_job_is_one_line(tmp_path: Path) -> None:
    folder = tmp_path / "a-folder-of-span-files-whose-path-is-long-enough-to-pass-eighty-columns"
    folder.mkdir()
    done = _prfaas(["trace", "no-such-job", "--dir", str(folder)], tmp_path)
    assert done.returncode == 1
    assert _one_error(done) == (
        f"error: no spans of job no-such-job in {folder} (a job's spans are written within a second of its end)"
    )


def test_bench_with_an_output_it_cannot_write_is_one_line(tmp_path: Path) -> None:
    blocker = tmp_path / ("a-file-where-a-folder-is-needed-" * 4)
    blocker.write_text("")
    done = _prfaas(["bench", "--json", str(blocker / "bench.json")], tmp_path)
    assert done.returncode == 2
    assert _one_error(done) == f"error: --json {blocker / 'bench.json'}: {blocker} is a file, not a folder"
