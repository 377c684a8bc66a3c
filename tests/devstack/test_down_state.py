"""`prfaas down` after a crashed run: its up.json may name pids the system has since given to other processes
(a supervisor pid, a process group's leader). Those are not signalled (before, `down` sent SIGTERM to whatever
process now had the supervisor's pid); the processes it did start are stopped."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from prfaas.devstack.processes import start_ticks
from prfaas.devstack.state import UpError, UpState, down, read_state, write_state


def _state(**fields: object) -> UpState:
    base = {"api_base": "", "api_key": "", "admin_key": "", "dashboard_url": "", "url": "", "tenant_id": "",
            "topology": "", "redis_url": "", "key_prefix": "prfaas-up-t", "registry": "", "log_dir": "",
            "emulate_wan": False}  # fmt: skip
    return UpState(**(base | fields))  # type: ignore[arg-type]


def test_down_signals_only_the_processes_its_run_started(tmp_path: Path) -> None:
    stranger = subprocess.Popen(["sleep", "300"], start_new_session=True)  # given a pid the crashed run had
    ours = subprocess.Popen(["sleep", "300"], start_new_session=True)  # a process the run did start
    try:
        then, now = start_ticks(stranger.pid), start_ticks(ours.pid)
        assert then is not None and now is not None
        started = {str(stranger.pid): then - 1, str(ours.pid): now}  # the run's process had started earlier
        state = _state(supervisor_pid=stranger.pid, groups={"worker-1": stranger.pid, "api": ours.pid}, started=started)
        write_state(tmp_path, state)
        said: list[str] = []
        assert down(tmp_path, said.append, timeout_s=5)
        assert ours.wait(10) is not None  # stopped
        assert stranger.poll() is None, said  # left alone: not the process the run recorded
        assert not (tmp_path / "up.json").exists()
    finally:
        for proc in (stranger, ours):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)


def test_down_does_not_signal_a_process_whose_start_time_was_not_recorded(tmp_path: Path) -> None:
    """No start time, no proof it is the run's: `ours` said yes, and `down` signalled whatever held the pid."""
    unknown = subprocess.Popen(["sleep", "300"], start_new_session=True)
    try:
        write_state(tmp_path, _state(supervisor_pid=unknown.pid, groups={"api": unknown.pid}))
        said: list[str] = []
        assert down(tmp_path, said.append, timeout_s=5)
        assert unknown.poll() is None, said
        assert f"skipped api (process group {unknown.pid}): no start time recorded, it may not be ours" in said
        assert f"skipped prfaas up (pid {unknown.pid}): no start time recorded, it may not be ours" in said
    finally:
        os.killpg(unknown.pid, signal.SIGKILL)
        unknown.wait(5)


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("groups", {"api": "abc"}, "groups.api: Input should be a valid integer"),  # a TypeError traceback
        ("namespaces", "abc", "namespaces: Input should be a valid array"),  # deleted namespaces a, b and c
        ("emulate_wan", "yes", "emulate_wan: Input should be a valid boolean"),
    ],
)
def test_down_refuses_a_state_of_the_wrong_shape_in_one_line_and_acts_on_none_of_it(
    tmp_path: Path, field: str, value: object, expected: str
) -> None:
    doc = json.loads(json.dumps(_state().__dict__)) | {field: value}
    (tmp_path / "up.json").write_text(json.dumps(doc))
    env = {**os.environ, "PRFAAS_HOME": str(tmp_path), "COLUMNS": "300"}
    out = subprocess.run([sys.executable, "-m", "prfaas.cli.main", "down"], env=env, capture_output=True, text=True,
                         timeout=60, check=False)  # fmt: skip
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stdout.startswith("error: ") and out.stdout.count("\n") == 1 and expected in out.stdout, out.stdout
    assert (tmp_path / "up.json").exists()  # left for the operator, as the message says


@pytest.mark.parametrize("pid", [-1, 0, 1])
def test_a_state_naming_a_pid_that_would_signal_everything_is_refused(tmp_path: Path, pid: int) -> None:
    """kill(-1) reaches every process, killpg(0) our own group, 1 is init: never a group `up` started. The
    supervisor is signalled alone (kill, not killpg) and may itself be a container's pid 1."""
    cases = [({"groups": {"api": pid}}, "greater than 1")]
    if pid < 1:
        cases.append(({"supervisor_pid": pid}, "greater than or equal to 1"))
    for fields, message in cases:
        (tmp_path / "up.json").write_text(json.dumps(json.loads(json.dumps(_state().__dict__)) | fields))
        with pytest.raises(UpError, match=message):
            read_state(tmp_path)


def test_the_state_of_an_up_running_as_a_containers_init_is_read_back(tmp_path: Path) -> None:
    """`prfaas up` as pid 1 (a container's init) writes `supervisor_pid: 1`: `down`, `bench` and `tour` read it."""
    write_state(tmp_path, _state(supervisor_pid=1))
    state = read_state(tmp_path)
    assert state is not None and state.supervisor_pid == 1


def test_up_json_is_created_0600_in_a_0700_home_without_a_chmod(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It holds the admin key: written 0644 (umask 022) and chmodded after, it was readable by all meanwhile.
    With chmod made a no-op, the file shows the mode it was created with."""
    monkeypatch.setattr(Path, "chmod", lambda *_, **__: None)
    monkeypatch.setattr(os, "chmod", lambda *_, **__: None)
    home = tmp_path / "home"
    previous = os.umask(0o022)
    try:
        write_state(home, _state(admin_key="secret"))
        write_state(home, _state(admin_key="secret"))  # replacing it too
    finally:
        os.umask(previous)
    assert stat.S_IMODE(os.stat(home / "up.json").st_mode) == 0o600
    assert stat.S_IMODE(os.stat(home).st_mode) == 0o700
    assert [p.name for p in home.iterdir()] == ["up.json"]  # no temp file left
