"""How `prfaas up` fails: one line naming the process, the cause and its log, before anything
starts when the topology's model is unknown; `failure_cause` on real tracebacks."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from prfaas.devstack.processes import failure_cause, log_cause

PRFAAS = [sys.executable, "-m", "prfaas.cli.main"]


def _python_output(code: str) -> list[str]:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode != 0
    return (done.stdout + done.stderr).splitlines()


def test_the_cause_is_the_exception_line_of_the_last_traceback() -> None:
    lines = _python_output(
        "import logging; logging.basicConfig(); logging.getLogger('x').error('error: first, not the cause')\n"
        "class ModelNotPrepared(Exception): pass\n"
        "def load():\n"
        "    try:\n"
        "        {}['missing']\n"
        "    except KeyError:\n"
        "        raise ModelNotPrepared(\"model 'm' is not prepared; run `prfaas model prepare m`\")\n"
        "load()\n"
    )
    assert sum(line.startswith("Traceback") for line in lines) == 2  # chained: the last one says why
    assert failure_cause(lines) == "ModelNotPrepared: model 'm' is not prepared; run `prfaas model prepare m`"


def test_without_a_traceback_the_last_error_line_then_the_last_line() -> None:
    assert failure_cause(["starting", "error: cannot bind 127.0.0.1:80: permission denied", "bye"]) == (
        "error: cannot bind 127.0.0.1:80: permission denied"
    )
    assert failure_cause(["starting", "killed by the OOM killer", ""]) == "killed by the OOM killer"
    assert failure_cause([]) == "no output"
    assert len(failure_cause(["x" * 1000])) == 300


def test_log_cause_reads_the_end_of_a_long_log(tmp_path: Path) -> None:
    log = tmp_path / "api.log"
    tail = 'Traceback (most recent call last):\n  File "x", line 1\nOSError: disk full\n'
    log.write_text("noise\n" * 50_000 + tail)
    assert log_cause(log) == "OSError: disk full"
    assert log_cause(tmp_path / "absent.log").startswith("no log")


def _up(tmp_path: Path, topology: dict[str, object]) -> subprocess.CompletedProcess[str]:
    (tmp_path / "topology.yaml").write_text(yaml.safe_dump(topology))
    env = {**os.environ, "PRFAAS_HOME": str(tmp_path / "home"), "COLUMNS": "250"}
    env.pop("PRFAAS_REDIS_URL", None)
    return subprocess.run([*PRFAAS, "up", "--detach", "--topology", str(tmp_path / "topology.yaml")], env=env,
                          capture_output=True, text=True, timeout=180, check=False)  # fmt: skip


TOPOLOGY = {
    "name": "f",
    "model": "tiny-llama",
    "regions": [
        {"name": "pre", "role": "prefill", "usd_per_gpu_hour": 0.5},
        {"name": "dec", "role": "decode", "usd_per_gpu_hour": 4.0},
    ],
    "links": [{"src": "pre", "dst": "dec", "rtt_ms": 10, "rate_mbit": 1000}],
}


def test_a_topology_naming_an_unknown_model_fails_in_one_line_before_anything_starts(tmp_path: Path) -> None:
    done = _up(tmp_path, TOPOLOGY | {"model": "llama-9000"})
    assert done.returncode == 2
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    assert lines == [
        "error: topology 'f': model: 'llama-9000' is neither a catalog model (smollm2-135m, tiny-llama) nor a "
        "folder with a config.json"
    ]
    assert not (tmp_path / "home" / "up").exists() and not (tmp_path / "home" / "up.json").exists()


def test_a_policy_that_does_not_validate_fails_in_one_line_before_anything_starts(tmp_path: Path) -> None:
    (tmp_path / "policy.yaml").write_text("version: 1\ndisaggregation: {min_uncached_tokens: lots}\n")
    done = _up(tmp_path, TOPOLOGY | {"policy": {"path": str(tmp_path / "policy.yaml")}})
    assert done.returncode == 2
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"error: policy {tmp_path / 'policy.yaml'}: "), lines
    assert "min_uncached_tokens" in lines[0]
    assert not (tmp_path / "home" / "up").exists()


@pytest.mark.e2e
def test_a_process_that_dies_at_start_is_one_line_with_its_cause_and_log(tmp_path: Path) -> None:
    """The API's port is taken: uvicorn exits, and `up` says which process, why (the error line
    of its log) and where the log is; what had started is stopped."""
    from prfaas.engine.models import models_root, prepare_model

    prepare_model("tiny-llama")
    (tmp_path / "home" / "models").mkdir(parents=True)
    os.symlink(models_root() / "tiny-llama", tmp_path / "home" / "models" / "tiny-llama")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = _up(tmp_path, TOPOLOGY | {"control_plane": {"api_port": port}})
    assert done.returncode == 2, done.stdout + done.stderr
    error = [line for line in done.stdout.splitlines() if line.startswith("error:")]
    log = tmp_path / "home" / "up" / "api.log"
    assert len(error) == 1, done.stdout
    assert error[0].startswith("error: api exited with status ") and error[0].endswith(f"(log {log})"), error
    assert "address already in use" in error[0].lower(), error  # the cause, from the log
    assert "Traceback" not in done.stdout + done.stderr
    assert not (tmp_path / "home" / "up.json").exists()  # what started was stopped
