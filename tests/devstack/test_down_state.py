"""`prfaas down` after a crashed run: its up.json may name pids the system has since given to other processes
(a supervisor pid, a process group's leader). Those are not signalled (before, `down` sent SIGTERM to whatever
process now had the supervisor's pid); the processes it did start are stopped."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

from prfaas.devstack.processes import start_ticks
from prfaas.devstack.state import UpState, down, write_state


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
