"""How `prfaas up` fails: one line naming the process, the cause and its log, before anything
starts when the topology's model is unknown; `failure_cause` on real tracebacks; a signal while it starts
(everything stops at once, exit 130); a process that dies while it starts (no "up")."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from prfaas.devstack.processes import failure_cause, log_cause, wait_until
from prfaas.telemetry.tracing import JOB_ID

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
    # an error line ending in ":" is followed by its details, indented (a region config's field errors)
    config = ["error: r.yaml: invalid region config:", "  kv_buffer_bytes: 'lots' is not a byte count",
              "  ticket_key: String should have at least 32 characters", "bye"]  # fmt: skip
    assert failure_cause(config) == (
        "error: r.yaml: invalid region config: kv_buffer_bytes: 'lots' is not a byte count "
        "ticket_key: String should have at least 32 characters"
    )
    assert len(failure_cause(["x" * 1000])) == 300


def test_a_traceback_after_a_loggers_prefix_is_found() -> None:
    """uvicorn logs a failed startup as `ERROR:    Traceback (most recent call last):`; the cause is its
    exception (a registry port in use), not uvicorn's closing line."""
    lines = ["INFO:     Waiting for application startup.", "ERROR:    Traceback (most recent call last):",
             '  File "registry.py", line 9, in serve', "RuntimeError: Failed to bind to address 127.0.0.1:47712",
             "", "ERROR:    Application startup failed. Exiting."]  # fmt: skip
    assert failure_cause(lines) == "RuntimeError: Failed to bind to address 127.0.0.1:47712"


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
    of its log) and where the log is; what had started is stopped. The run before it stays readable in
    up.previous/ (its log, its spans for `prfaas trace`), without its keys and configs: before, every `up`
    deleted it."""
    _models_home(tmp_path)
    before = tmp_path / "home" / "up"
    (before / "traces").mkdir(parents=True)
    (before / "pki").mkdir()
    (before / "api.log").write_text("the run before\n")
    (before / "region-dec.yaml").write_text("ticket_key: secret\n")
    job = "e332a3ca-0b5f-4c1e-9d7a-1f2e3d4c5b6a"
    span = {"trace_id": "a" * 32, "span_id": "0" * 15 + "1", "parent_id": "", "name": "api.job", "service": "api",
            "start_ns": 1_000, "end_ns": 9_000, "status": "ok", "attributes": {JOB_ID: job}}  # fmt: skip
    (before / "traces" / "api-1.jsonl").write_text(json.dumps(span) + "\n")
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
    previous = tmp_path / "home" / "up.previous"
    assert (previous / "api.log").read_text() == "the run before\n"
    assert not (previous / "pki").exists() and not list(previous.glob("*.yaml"))
    env = {**os.environ, "PRFAAS_HOME": str(tmp_path / "home"), "COLUMNS": "200"}
    trace = subprocess.run([*PRFAAS, "trace", job[:8], "--json"], env=env, capture_output=True, text=True,
                           timeout=60, check=False)  # fmt: skip
    assert trace.returncode == 0 and json.loads(trace.stdout)[0]["attributes"][JOB_ID] == job, trace.stdout


def _models_home(tmp_path: Path) -> dict[str, str]:
    """A PRFAAS_HOME whose tiny-llama is the shared one; the environment of a `prfaas up` in it."""
    from prfaas.engine.models import models_root, prepare_model

    prepare_model("tiny-llama")
    (tmp_path / "home" / "models").mkdir(parents=True)
    os.symlink(models_root() / "tiny-llama", tmp_path / "home" / "models" / "tiny-llama")
    env = {**os.environ, "PRFAAS_HOME": str(tmp_path / "home"), "COLUMNS": "250"}
    env.pop("PRFAAS_REDIS_URL", None)
    return env


@contextlib.contextmanager
def _started(tmp_path: Path, topology: dict[str, object], *flags: str) -> Iterator[tuple[subprocess.Popen[str], Path]]:
    """`prfaas up` running (its output in the file given); whatever it leaves is stopped after (`prfaas down`)."""
    (tmp_path / "topology.yaml").write_text(yaml.safe_dump(topology))
    out, env = tmp_path / "up.out", _models_home(tmp_path)
    with out.open("w") as sink:
        proc = subprocess.Popen([*PRFAAS, "up", *flags, "--topology", str(tmp_path / "topology.yaml")], env=env,
                                stdout=sink, stderr=subprocess.STDOUT, text=True, start_new_session=True)  # fmt: skip
    try:
        yield proc, out
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        subprocess.run([*PRFAAS, "down"], env=env, capture_output=True, timeout=120, check=False)
        subprocess.run(["pkill", "-9", "-f", str(tmp_path)], check=False)


def _left(tmp_path: Path) -> list[str]:
    """Command lines of processes still running that belong to the deployment in `tmp_path`."""
    found = []
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            if entry.name.isdigit() and str(tmp_path) in (line := (entry / "cmdline").read_text().replace("\0", " ")):
                found.append(line)
    return found


@pytest.mark.e2e
def test_a_signal_while_a_region_loads_stops_everything_at_once(tmp_path: Path) -> None:
    """Ctrl-C while a region is still starting (here a vLLM region whose server never comes up): `up` stops
    every process at once, the loading region included, and exits 130; it waited for every region to be ready
    first (up to 180 s + the vLLM start timeout), and a region not yet ready was not recorded for `down`."""
    fake = tmp_path / "fake-vllm-python"
    fake.write_text('#!/bin/bash\nif [ "$1" = "-c" ]; then echo "[]"; exit 0; fi\nexec sleep 900\n')
    fake.chmod(0o755)
    slow = {"engine": "vllm", "vllm": {"python": str(fake), "start_timeout_s": 300}}
    regions = [TOPOLOGY["regions"][0], {"name": "dec", "role": "decode", "usd_per_gpu_hour": 4.0, "extra": slow}]
    with _started(tmp_path, TOPOLOGY | {"regions": regions}) as (proc, out):
        wait_until(lambda: "region pre" in out.read_text(), 120, 0.2)  # the other region is up; dec loads
        time.sleep(1.0)
        started = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(60) == 130, out.read_text()
        print(f"stopped {time.monotonic() - started:.1f} s after the signal")
        assert "interrupted before the deployment was up" in out.read_text()
        assert _left(tmp_path) == []


@pytest.mark.e2e
def test_a_process_that_dies_while_up_starts_fails_it(tmp_path: Path) -> None:
    """The Celery worker killed while the regions load: `up --detach` says so and exits 2, not "up" with a
    deployment whose split jobs hang."""
    with _started(tmp_path, TOPOLOGY, "--detach") as (proc, out):
        wait_until(lambda: "control plane:" in out.read_text(), 120, 0.1)
        state = json.loads((tmp_path / "home" / "up.json").read_text())
        os.killpg(state["groups"]["worker-1"], signal.SIGKILL)
        assert proc.wait(120) == 2, out.read_text()
        error = [line for line in out.read_text().splitlines() if line.startswith("error:")]
        assert len(error) == 1 and error[0].startswith("error: worker-1 exited with status -9"), error
        assert not (tmp_path / "home" / "up.json").exists() and _left(tmp_path) == []
