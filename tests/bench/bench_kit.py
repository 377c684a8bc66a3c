"""Runs bench/ in a child process, the way its users do. The tests never import the benchmarks
(test_layering.py: nothing imports them, not even the tests): a test runs a script's command
line (`script`) or a few lines of Python in a child interpreter (`python`) and reads what it
printed. Each child has a process group of its own, killed whole at its deadline, so a script
that got further than it should have leaves no process behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(argv: list[str], stdin: str, env: dict[str, str] | None, timeout_s: float) -> subprocess.CompletedProcess[str]:
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=ROOT, start_new_session=True)  # fmt: skip
    try:
        out, err = proc.communicate(stdin, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{argv[1:3]} still running after {timeout_s} s (killed); stderr: {err[-2000:]}")
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def script(
    name: str, *args: str, env: dict[str, str] | None = None, timeout_s: float = 60.0
) -> subprocess.CompletedProcess[str]:
    """`python bench/<name> args...`; stdout, stderr and the exit code."""
    return _run([sys.executable, str(ROOT / "bench" / name), *args], "", env, timeout_s)


def python(code: str, stdin: Any = None, timeout_s: float = 60.0) -> Any:
    """Run `code` in a child interpreter with `stdin` as JSON on its stdin; the JSON value it printed
    last (its own line). Fails the test when the child fails."""
    done = _run([sys.executable, "-c", code], json.dumps(stdin), None, timeout_s)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def unusable_home(tmp_path: Path) -> dict[str, str]:
    """The environment with PRFAAS_HOME under a plain file: nothing can be read or built there, so a
    script that goes past its argument checks fails at once instead of building a model or starting
    a deployment."""
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    return {**os.environ, "PRFAAS_HOME": str(blocker / "home"), "HF_HUB_OFFLINE": "1"}


# main() of a bench script for each of several command lines in one child interpreter (the import alone takes
# seconds), with what it would start stubbed to raise: a command line that got past the argument checks says so
# instead of loading a model. Prints [exit code or exception name, stderr or message] per command line.
_USAGE = """
import contextlib, io, json, sys
import prfaas.bench.{name} as script

def past_the_checks(*args, **kwargs):
    raise RuntimeError("went past the argument checks")

script.HFEngine = script.fresh_deployment = past_the_checks
results = []
for argv in json.load(sys.stdin):
    sys.argv, err = ["{name}.py", *argv], io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            script.main()
        results.append([None, err.getvalue()])
    except SystemExit as exc:
        results.append([exc.code, err.getvalue()])
    except Exception as exc:
        results.append([type(exc).__name__, str(exc)])
print(json.dumps(results))
"""


def usage_outcomes(name: str, argvs: list[list[str]]) -> dict[str, list[object]]:
    """bench/<name>.py's main() on each of `argvs` with its model and deployment stubbed to raise (`_USAGE`):
    " ".join(argv) -> [exit code (2: a usage error) or the exception's name, stderr or its message]."""
    results = python(_USAGE.replace("{name}", name), argvs)
    return {" ".join(argv): result for argv, result in zip(argvs, results, strict=True)}
