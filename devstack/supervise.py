"""What a foreground `prfaas up` does while the deployment runs: a process that exits on its own (a crash, an
OOM kill, an operator's `kill -9`) is started again as it was started (`Deployment.restart`), as systemd's
`Restart=on-failure` would: 1 s after, the wait doubling up to 30 s for one that keeps crashing, at most
`topology.restarts` times in 10 minutes, after which it is left down and said so. A process that exits cleanly
(status 0, or on SIGTERM, SIGINT, SIGHUP: an operator stopped or drained it) is left down. A private Redis
comes back empty (jobs in flight are lost; the rest is rebuilt from the database). The link emulators of
`--emulate-wan` are not supervised. Before, `up` only warned, and a
process started again by hand escaped `prfaas down`; the default single Celery worker dead meant no job was
dispatched or recovered again."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

WINDOW_S = 600.0
FIRST_WAIT_S = 1.0
MAX_WAIT_S = 30.0
# exits that are no failure (systemd's Restart=on-failure leaves them down too): status 0, and the signals an
# operator stops a process with (a region drained by SIGTERM exits so)
CLEAN_EXITS = frozenset({0, -signal.SIGTERM, -signal.SIGINT, -signal.SIGHUP, -signal.SIGPIPE})


class Supervised(Protocol):
    run_dir: Path

    def dead(self) -> list[str]: ...

    def exit_status(self, name: str) -> int | None: ...

    def restart(self, name: str) -> None: ...


@dataclass
class Restarts:
    """When each crashed process is due to start again; None once it crashed more than `limit` times in
    WINDOW_S (or `limit` is 0)."""

    limit: int
    crashes: dict[str, list[float]] = field(default_factory=dict)

    def crashed(self, name: str, now: float) -> float | None:
        """A crash of `name` at `now` (monotonic s): -> the wait before it starts again, or None."""
        recent = [t for t in self.crashes.get(name, []) if now - t < WINDOW_S] + [now]
        self.crashes[name] = recent
        if len(recent) > self.limit:
            return None
        return float(min(MAX_WAIT_S, FIRST_WAIT_S * 2.0 ** (len(recent) - 1)))


class Supervisor:
    """One `step()` every half second from `up`'s foreground loop. Each restart runs on a thread of its own (a
    region loads its model for minutes): the loop, and the signals the main thread takes, never wait for one."""

    def __init__(self, deployment: Supervised, limit: int, tell: Callable[[str], None]) -> None:
        self.deployment = deployment
        self.restarts = Restarts(limit)
        self.tell = tell
        self.due: dict[str, float] = {}  # crashed, starting again at (monotonic s)
        self.starting: dict[str, threading.Thread] = {}
        self.left_down: set[str] = set()

    def step(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        for name in self.deployment.dead():
            if name in self.due or name in self.starting or name in self.left_down:
                continue
            status = self.deployment.exit_status(name)
            log = self.deployment.run_dir / f"{name}.log"
            if status in CLEAN_EXITS:
                self.left_down.add(name)
                self.tell(f"warning: {name} exited (status {status}), as a process told to stop does; left down "
                          f"(log {log})")  # fmt: skip
                continue
            wait_s = self.restarts.crashed(name, now)
            if wait_s is None:
                self.left_down.add(name)
                self.tell(f"warning: {name} exited (status {status}); it crashed {self.restarts.limit + 1} times in "
                          f"{WINDOW_S / 60:g} minutes and is left down (log {log})")  # fmt: skip
                continue
            self.tell(f"warning: {name} exited (status {status}); starting it again in {wait_s:g} s (log {log})")
            self.due[name] = now + wait_s
        for name, at in sorted(self.due.items(), key=lambda item: item[1]):
            if at > now:
                continue
            del self.due[name]
            thread = self.starting[name] = threading.Thread(target=self._restart, args=(name,), daemon=True,
                                                            name=f"restart-{name}")  # fmt: skip
            thread.start()

    def wait(self, timeout_s: float) -> None:
        """Until the restarts under way have ended (tests)."""
        for thread in list(self.starting.values()):
            thread.join(timeout_s)

    def _restart(self, name: str) -> None:
        try:
            self.deployment.restart(name)
        except Exception as exc:  # it exits again, or never served: the next step counts another crash
            self.tell(f"warning: {name} did not start again: {exc}")
        else:
            emptied = " (empty: the jobs in flight were lost; tenants and links come back from the database)"
            self.tell(f"{name} started again{emptied if name == 'redis' else ''}")
        finally:
            self.starting.pop(name, None)
