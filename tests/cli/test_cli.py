"""The `prfaas` command as a user runs it: a real process, real exit codes."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from prfaas.engine.models import models_root, prepare_model

PRFAAS = [sys.executable, "-m", "prfaas.cli.main"]


def run(args: list[str], home: Path, timeout_s: float = 300) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PRFAAS_HOME": str(home), "COLUMNS": "200"}
    return subprocess.run([*PRFAAS, *args], env=env, capture_output=True, text=True, timeout=timeout_s, check=False)


def test_model_list_shows_the_catalog_and_its_state(tmp_path: Path) -> None:
    out = run(["model", "list"], tmp_path)
    assert out.returncode == 0, out.stderr
    assert "smollm2-135m" in out.stdout
    assert "tiny-llama" in out.stdout
    assert str(tmp_path / "models") in out.stdout.replace("\n", "")


def test_preparing_an_unknown_model_fails_with_a_clear_message(tmp_path: Path) -> None:
    out = run(["model", "prepare", "llama-9000"], tmp_path)
    assert out.returncode == 2
    assert "unknown model 'llama-9000'; available: smollm2-135m, tiny-llama" in out.stdout


def test_demo_on_an_unprepared_model_says_how_to_prepare_it(tmp_path: Path) -> None:
    out = run(["demo", "--model", "tiny-llama"], tmp_path)
    assert out.returncode == 2
    assert "run `prfaas model prepare tiny-llama`" in out.stdout


@pytest.mark.e2e
def test_demo_prints_identical_split_and_colocated_outputs(tmp_path: Path) -> None:
    prepare_model("tiny-llama")
    (tmp_path / "models").mkdir()
    shutil.copytree(models_root() / "tiny-llama", tmp_path / "models" / "tiny-llama")
    out = run(["demo", "--model", "tiny-llama", "--max-new-tokens", "12"], tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    for expected in ["colocated", "split", "prefill s", "decode ms/token", "KV bytes/token: 1,024", "identical"]:
        assert expected in out.stdout


@pytest.mark.parametrize("command", [["regions", "import"], ["up", "--topology"]])
def test_a_file_that_is_not_utf8_text_is_one_line_and_exit_2(command: list[str], tmp_path: Path) -> None:
    """A binary file was a UnicodeDecodeError traceback (only OSError was caught)."""
    binary = tmp_path / "binary"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    out = run([*command, str(binary)], tmp_path, timeout_s=60)
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stdout.startswith(f"error: {binary}: not UTF-8 text (byte 0)") and out.stdout.count("\n") == 1
    assert "Traceback" not in out.stdout + out.stderr
