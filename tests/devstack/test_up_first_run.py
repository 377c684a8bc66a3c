"""An operator's first `prfaas up`, its output piped (a log, CI): the home it makes is 0700 although the model
is built in it first, each step of that build is a line (no bar shows off a terminal), an error is one line
however long, and a second `up` while one runs says so before building anything. The control plane's
database is created 0600 before the API opens it."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from prfaas.devstack.deployment import Deployment
from prfaas.devstack.processes import pid_alive
from prfaas.devstack.state import UpState, write_state
from prfaas.devstack.topology import topology_from_mapping

PRFAAS = [sys.executable, "-m", "prfaas.cli.main"]
TOPOLOGY = {
    "name": "first",
    "model": "tiny-llama",
    "regions": [
        {"name": "pre", "role": "prefill", "usd_per_gpu_hour": 0.5},
        {"name": "dec", "role": "decode", "usd_per_gpu_hour": 4.0},
    ],
    "links": [{"src": "pre", "dst": "dec", "rtt_ms": 10, "rate_mbit": 1000}],
}


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _up(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """`prfaas up --detach --insecure` in a home of its own, umask 022, no COLUMNS (rich's 80 columns)."""
    (tmp_path / "topology.yaml").write_text(yaml.safe_dump(TOPOLOGY))
    base = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "PRFAAS_REDIS_URL")}
    return subprocess.run([*PRFAAS, "up", "--detach", "--insecure", "--topology", str(tmp_path / "topology.yaml")],
                          env=base | {"PRFAAS_HOME": str(tmp_path / "home")} | env, capture_output=True, text=True,
                          timeout=300, check=False, preexec_fn=lambda: os.umask(0o022))  # fmt: skip


def test_a_first_up_makes_its_home_0700_and_says_each_step_of_the_model_build(tmp_path: Path) -> None:
    """No Redis answers and none can be started (no redis-server on PATH): `up` fails after the model build,
    in one line although it is longer than 80 columns. Before, the build made the home 0755 (the later 0700
    mkdir found it there), a piped run showed nothing while it built, and the error was cut at 80 columns."""
    (tmp_path / "bin").mkdir()
    done = _up(tmp_path, PATH=str(tmp_path / "bin"), PRFAAS_REDIS_URL="redis://127.0.0.1:1/0")
    output = done.stdout + done.stderr
    assert done.returncode == 2, output
    home = tmp_path / "home"
    assert _mode(home) == 0o700, oct(_mode(home))
    lines = output.splitlines()
    started = f"preparing model tiny-llama in {home / 'models'} (first run only)"
    assert started in lines, output
    prepared = next(i for i, line in enumerate(lines) if line.startswith("prepared tiny-llama at "))
    assert lines.index(started) < prepared and lines[prepared].endswith("...)"), output  # one line
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].endswith("macOS: `brew install redis`)"), output
    assert len(errors[0]) > 80


def test_model_prepare_on_a_fresh_home_makes_it_0700(tmp_path: Path) -> None:
    """`prfaas model prepare` before the first `up` makes the home `up` keeps its keys in: 0700 too (was 0755)."""
    env = {**os.environ, "PRFAAS_HOME": str(tmp_path / "home")}
    done = subprocess.run([*PRFAAS, "model", "prepare", "tiny-llama"], env=env, capture_output=True, text=True,
                          timeout=300, check=False, preexec_fn=lambda: os.umask(0o022))  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert _mode(tmp_path / "home") == 0o700 and _mode(tmp_path / "home" / "models" / "tiny-llama") == 0o755


@pytest.fixture
def supervisor() -> Iterator[int]:
    """A live process that up.json names as its `prfaas up` (with its start time: still the same one)."""
    proc = subprocess.Popen(["sleep", "120"], start_new_session=True)
    try:
        yield proc.pid
    finally:
        proc.kill()
        proc.wait()


def test_up_while_a_deployment_is_up_says_so_before_building_its_model(tmp_path: Path, supervisor: int) -> None:
    """Before, `up` built the topology's model (a minute for SmolLM2) and only then said a deployment was up."""
    home = tmp_path / "home"
    state = UpState(api_base="", api_key="", admin_key="", dashboard_url="", url="http://127.0.0.1:9", tenant_id="",
                    topology="", redis_url="", key_prefix="prfaas-up-first", registry="", log_dir="",
                    emulate_wan=False, supervisor_pid=supervisor)  # fmt: skip
    state.record(supervisor)
    write_state(home, state)
    done = _up(tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stdout.splitlines() == [
        "error: a deployment is already up (http://127.0.0.1:9); run `prfaas down` first"
    ]
    assert not (home / "models").exists()  # nothing was built
    assert pid_alive(supervisor) and (home / "up.json").exists()  # nor stopped


def test_the_control_plane_database_is_made_0600_before_the_api_opens_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It holds the tenants, their keys' digests and the ledger: before, SQLite created it 0644 (and its -wal
    and -shm files, which take its mode). One an earlier run left 0644 is narrowed; a database the operator
    names (PRFAAS_LEDGER_URL) is not `up`'s to touch."""
    monkeypatch.delenv("PRFAAS_LEDGER_URL", raising=False)
    previous = os.umask(0o022)
    try:
        deployment = Deployment(topology_from_mapping(TOPOLOGY), "t.yaml", tmp_path / "home", False, print)
        deployment.run_dir.mkdir(parents=True)
        env = deployment._cp_env()
        database = tmp_path / "home" / "deployments" / "first" / "control-plane.db"
        assert env["PRFAAS_LEDGER_URL"] == f"sqlite:///{database}"
        assert (_mode(database), _mode(database.parent)) == (0o600, 0o700)
        database.chmod(0o644)  # an earlier run's
        database.parent.chmod(0o755)
        database.with_name("control-plane.db-wal").touch(mode=0o644)
        deployment._cp_env()
        assert _mode(database) == _mode(database.with_name("control-plane.db-wal")) == 0o600
        assert _mode(database.parent) == 0o700
        monkeypatch.setenv("PRFAAS_LEDGER_URL", f"sqlite:///{tmp_path / 'mine.db'}")
        assert deployment._cp_env()["PRFAAS_LEDGER_URL"] == f"sqlite:///{tmp_path / 'mine.db'}"
        assert not (tmp_path / "mine.db").exists()
    finally:
        os.umask(previous)
