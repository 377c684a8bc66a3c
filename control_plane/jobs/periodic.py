"""Periodic: run a function every `interval_s` on a daemon thread until stopped.

Heartbeats and the sweeper both run one. An exception the function raises is handed to
`on_error` and the next tick runs as planned: a periodic duty never dies of one bad pass.
"""

from __future__ import annotations

import threading
from collections.abc import Callable


class Periodic:
    def __init__(
        self, name: str, interval_s: float, tick: Callable[[], object], on_error: Callable[[Exception], None]
    ) -> None:
        self.name = name
        self.interval_s = interval_s
        self._tick = tick
        self._on_error = on_error
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Idempotent; the first tick comes `interval_s` after the start."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            self._thread.start()

    def stop(self, join_s: float) -> None:
        """Stop ticking; waits up to `join_s` for a tick under way to end."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(join_s)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._tick()
            except Exception as exc:
                self._on_error(exc)
