"""A bench process driven over its pipes: one JSON command per line on its stdin, one JSON reply
per line on its stdout (bench/transport_loopback.py, transport_wan.py, transport_matrix.py).

A pipe's `readline()` has no timeout, so a thread reads the replies into a queue and every
`read` waits on that queue with a deadline; past it the process is killed and `read` raises
RuntimeError (a hung role fails the run instead of blocking it forever). Lines that are not
JSON objects (a library's chatter on stdout) are skipped.
"""

from __future__ import annotations

import contextlib
import json
import queue
import subprocess
import threading
import time
from collections.abc import Callable
from typing import Any

# start(argv, **popen_kwargs) -> Popen: subprocess.Popen, or one that starts it elsewhere (a namespace)
Start = Callable[..., "subprocess.Popen[str]"]


class Piped:
    """`argv` started by `start` with `env`, its stdin and stdout pipes in text mode."""

    def __init__(self, argv: list[str], env: dict[str, str] | None = None, start: Start = subprocess.Popen) -> None:
        self.p = start(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.exited = False  # its stdout ended: every later read raises at once
        threading.Thread(target=self._pump, name=f"piped-{self.p.pid}", daemon=True).start()

    def _pump(self) -> None:
        assert self.p.stdout is not None
        with contextlib.suppress(ValueError, OSError):  # the pipe closed under the loop
            for line in self.p.stdout:
                self.lines.put(line)
        self.lines.put(None)

    def send(self, msg: dict[str, Any]) -> None:
        """RuntimeError when the process is gone (its stdin closed)."""
        assert self.p.stdin is not None
        try:
            self.p.stdin.write(json.dumps(msg) + "\n")
            self.p.stdin.flush()
        except (BrokenPipeError, ValueError) as exc:  # ValueError: our side of the pipe closed
            raise RuntimeError(f"bench process {self.p.args!r} is gone ({exc}); exit {self.p.poll()}") from None

    def read(self, timeout_s: float = 60.0) -> dict[str, Any]:
        """The next JSON reply; RuntimeError when the process exits first, or stays silent for
        `timeout_s` (it is killed then)."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self.exited:
                raise RuntimeError(f"bench process {self.p.args!r} exited with {self.p.wait()}")
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self.kill()
                raise RuntimeError(f"bench process {self.p.args!r} silent for {timeout_s:g} s; killed") from None
            if line is None:
                self.exited = True
                continue
            with contextlib.suppress(json.JSONDecodeError):
                reply = json.loads(line)
                if isinstance(reply, dict):
                    return reply

    def ask(self, wait_s: float = 60.0, **cmd: Any) -> dict[str, Any]:
        """Send `cmd`, return the reply (`read(wait_s)`)."""
        self.send(cmd)
        return self.read(wait_s)

    def kill(self) -> None:
        with contextlib.suppress(OSError):
            self.p.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.p.wait(10)

    def close(self, grace_s: float = 10.0) -> None:
        """Close its stdin (the roles end their command loop on EOF); kill it past `grace_s`."""
        with contextlib.suppress(OSError):
            if self.p.stdin is not None:
                self.p.stdin.close()
        try:
            self.p.wait(grace_s)
        except subprocess.TimeoutExpired:
            self.kill()
