"""What a foreground `prfaas up` does while the deployment runs: a process that exits on its own (a crash, an
OOM kill, an operator's `kill -9`) is started again as it was started (`Deployment.restart`), as systemd's
`Restart=on-failure` would: 1 s after, the wait doubling up to 30 s for one that keeps crashing, at most
`topology.restarts` times in 10 minutes, after which it is left down and said so. Before, `up` only warned, and a
process started again by hand escaped `prfaas down`; the default single Celery worker dead meant no job was
dispatched or recovered again."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

WINDOW_S = 600.0
FIRST_WAIT_S = 1.0
MAX_WAIT_S = 30.0


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
    """One `step()` every half second from `up`'s foreground loop."""

    def __init__(self, deployment: Supervised, limit: int, tell: Callable[[str], None]) -> None:
        self.deployment = deployment
        self.restarts = Restarts(limit)
        self.tell = tell
        self.due: dict[str, float] = {}  # crashed, starting again at (monotonic s)
        self.left_down: set[str] = set()

    def step(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        for name in self.deployment.dead():
            if name in self.due or name in self.left_down:
                continue
            status = self.deployment.exit_status(name)
            log = self.deployment.run_dir / f"{name}.log"
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
            try:
                self.deployment.restart(name)
            except Exception as exc:  # it exits again, or never served: the next step counts another crash
                self.tell(f"warning: {name} did not start again: {exc}")
                continue
            self.tell(f"{name} started again")
