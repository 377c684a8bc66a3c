"""Long waits off a terminal (a log, CI, `make demo | tee`), where rich shows no progress bar: `prfaas bench`
(part 2 of `prfaas tour`) prints a line as each policy finishes, and `prfaas up`'s model build a line as it
starts and one every 20 s. Before, three policies of the tour were 98 s without a line."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rich.console import Console

sys.path.insert(0, str(Path(__file__).parents[1] / "loadgen"))  # the fake OpenAI API of the loadgen tests
from api_kit import answer, fake_api

# `prfaas bench` with the corpus stubbed (loadgen.bench.corpus tokenizes with a prepared model's tokenizer)
STUBBED = ("import sys, prfaas.loadgen.bench as b; b.corpus = lambda model: (list(range(1000, 3000)), 2048); "
           "from prfaas.cli.main import app; sys.argv[0] = 'prfaas'; app()")  # fmt: skip


def test_bench_off_a_terminal_prints_a_line_per_finished_policy(tmp_path: Path) -> None:
    env = {**os.environ, "PRFAAS_HOME": str(tmp_path / "home"), "COLUMNS": "200"}
    with fake_api(answer) as api:
        args = ["bench", "--api-base", api.url, "--api-key", "k", "--model", "m", "-n", "3", "--concurrency", "2",
                "--warmup", "0", "--input-len", "fixed:8", "--output-len", "fixed:2", "--compare",
                "colocated,split-always", "--out", str(tmp_path / "out")]  # fmt: skip
        done = subprocess.run([sys.executable, "-c", STUBBED, *args], env=env, capture_output=True, text=True,
                              timeout=120, check=False)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    finished = [line for line in lines if " done (" in line]
    assert [line.split(" done (")[0] for line in finished] == ["colocated: 3/3", "split-always: 3/3"], done.stdout
    assert all(line.endswith(" s)") for line in finished), finished
    assert lines.index(finished[1]) < next(i for i, line in enumerate(lines) if "ratio to colocated" in line)
    bars = [line for line in lines if re.match(r"(colocated|split-always) +━", line)]
    assert not bars, done.stdout  # the bars' last frame, after the lines that say the same


def test_a_model_build_off_a_terminal_is_a_line_now_and_one_every_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    from prfaas.cli import model

    out = io.StringIO()
    monkeypatch.setattr(model, "console", Console(file=out, force_terminal=False, width=80))
    with model._building("preparing model m in /a/folder/whose/path/is/long/enough/to/pass/eighty/columns", 0.05):
        time.sleep(0.3)
    lines = out.getvalue().splitlines()
    what = "preparing model m in /a/folder/whose/path/is/long/enough/to/pass/eighty/columns"
    assert lines[0] == f"{what} (first run only)"  # whole: not cut at 80 columns
    assert len(lines) >= 3 and all(line.startswith(f"{what}: ") and line.endswith(" s") for line in lines[1:])
    time.sleep(0.15)
    assert len(out.getvalue().splitlines()) == len(lines)  # none after the build
