"""The restart policy of a foreground `prfaas up` (devstack/supervise.py) over real processes: a crashed process
is started again after 1 s, the wait doubling to 30 s, at most `limit` times in 10 minutes, then left down. The
deployment here is real `sleep` processes a test kills; the whole `up` is test_up_down.py's."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

from prfaas.devstack.supervise import MAX_WAIT_S, WINDOW_S, Restarts, Supervisor


class Sleepers:
    """Processes named as `up` names them, each a `sleep`; `restart` starts one again."""

    def __init__(self, run_dir: Path, names: list[str]) -> None:
        self.run_dir = run_dir
        self.procs = {name: subprocess.Popen(["sleep", "600"]) for name in names}
        self.started: list[str] = []

    def dead(self) -> list[str]:
        return [name for name, proc in self.procs.items() if proc.poll() is not None]

    def exit_status(self, name: str) -> int | None:
        return self.procs[name].returncode

    def restart(self, name: str) -> None:
        self.procs[name] = subprocess.Popen(["sleep", "600"])
        self.started.append(name)

    def kill(self, name: str) -> None:
        self.procs[name].send_signal(signal.SIGKILL)
        self.procs[name].wait(5)

    def close(self) -> None:
        for proc in self.procs.values():
            proc.kill()
            proc.wait(5)


def test_the_wait_doubles_to_its_cap_and_a_process_crashing_past_the_limit_is_left_down() -> None:
    restarts = Restarts(limit=7)
    waits = [restarts.crashed("worker-1", t) for t in range(8)]
    assert waits == [1, 2, 4, 8, 16, MAX_WAIT_S, MAX_WAIT_S, None]
    assert restarts.crashed("api", 0) == 1  # each process counts its own
    assert Restarts(limit=3).crashed("x", 0) == 1
    spaced = Restarts(limit=1)
    assert spaced.crashed("x", 0) == 1 and spaced.crashed("x", WINDOW_S + 1) == 1  # the first fell out of the window
    assert Restarts(limit=0).crashed("x", 0) is None  # restarts: 0 -> never


def test_a_killed_process_is_started_again_and_one_that_keeps_crashing_is_left_down(tmp_path: Path) -> None:
    said: list[str] = []
    deployment = Sleepers(tmp_path, ["api", "worker-1"])
    supervisor = Supervisor(deployment, limit=1, tell=said.append)
    try:
        deployment.kill("worker-1")
        supervisor.step(now=100.0)
        assert said == [f"warning: worker-1 exited (status -9); starting it again in 1 s (log {tmp_path}/worker-1.log)"]
        supervisor.step(now=100.5)
        assert deployment.started == []  # not before its wait
        supervisor.step(now=101.0)
        supervisor.wait(5)  # on a thread of its own
        assert deployment.started == ["worker-1"] and said[-1] == "worker-1 started again"
        assert deployment.dead() == []  # the new one runs
        deployment.kill("worker-1")  # a second crash within the window: past limit 1
        supervisor.step(now=102.0)
        supervisor.step(now=200.0)
        supervisor.wait(5)
        assert deployment.started == ["worker-1"] and "is left down" in said[-1], said
        assert deployment.procs["api"].poll() is None  # the others untouched
    finally:
        deployment.close()


def test_a_process_stopped_on_purpose_is_left_down(tmp_path: Path) -> None:
    """As systemd's Restart=on-failure: SIGTERM (an operator's stop, a region's drain) is no crash."""
    said: list[str] = []
    deployment = Sleepers(tmp_path, ["region-a"])
    supervisor = Supervisor(deployment, limit=5, tell=said.append)
    try:
        deployment.procs["region-a"].send_signal(signal.SIGTERM)
        deployment.procs["region-a"].wait(5)
        for now in (100.0, 110.0):
            supervisor.step(now=now)
        supervisor.wait(5)
        assert deployment.started == [] and len(said) == 1 and "status -15" in said[0] and "left down" in said[0]
    finally:
        deployment.close()
