"""`--json`, `--png`, `--out` (cli/outputs.py): a path that cannot be written is refused before the work, exit 2
naming the option; before, bench and sim ran to the end and then failed (or wrote somewhere else)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SIM = ["sim", "run", "--scenario", "small", "--requests", "300", "--policy", "prfaas"]


def _prfaas(args: list[str], home: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PRFAAS_HOME": str(home), "COLUMNS": "300"}
    env.pop("PRFAAS_API_KEY", None)
    return subprocess.run([sys.executable, "-m", "prfaas.cli.main", *args], env=env, capture_output=True, text=True,
                          timeout=120, check=False)  # fmt: skip


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["bench", "--json", "{dir}"], "--json {dir}: is a folder; give a file name"),
        (["bench", "--out", "{file}"], "--out {file}: is a file; give a folder"),
        (["bench", "--json", "{file}/bench.json"], "--json {file}/bench.json: {file} is a file, not a folder"),
        (["tour", "--json", "{dir}"], "--json {dir}: is a folder; give a file name"),
        ([*SIM, "--json", "{dir}"], "--json {dir}: is a folder; give a file name"),
        ([*SIM, "--png", "{dir}"], "--png {dir}: is a folder; give a file name"),  # "wrote DIR", DIR.png written
        ([*SIM, "--png", "{dir}/chart.txt"], "--png {dir}/chart.txt: a chart is one of"),
        (["sim", "plan", "--png", "{file}/x.png"], "--png {file}/x.png: {file} is a file, not a folder"),
    ],
)
def test_an_output_path_that_cannot_be_written_is_refused_before_the_work(
    args: list[str], expected: str, tmp_path: Path
) -> None:
    """bench and tour without a deployment said "nothing is up" (the path was checked after the run); sim ran
    first."""
    folder, file = tmp_path / "out", tmp_path / "a-file"
    folder.mkdir()
    file.write_text("kept")
    fill = {"dir": str(folder), "file": str(file)}
    out = _prfaas([a.format(**fill) for a in args], tmp_path)
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stdout.startswith(f"error: {expected.format(**fill)}") and out.stdout.count("\n") == 1, out.stdout
    assert file.read_text() == "kept" and list(folder.iterdir()) == []


def test_sim_run_png_without_a_suffix_says_the_file_it_wrote(tmp_path: Path) -> None:
    """matplotlib appends .png to a name without a suffix: "wrote NAME" named a file that does not exist."""
    out = _prfaas([*SIM, "--png", str(tmp_path / "chart")], tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"wrote {tmp_path / 'chart.png'}" in out.stdout and (tmp_path / "chart.png").is_file()
