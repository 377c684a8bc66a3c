"""The API process's drain on SIGTERM or SIGINT, as vLLM's `--shutdown-timeout`: from the signal on, `/readyz`
and new generation requests get 503 `server_shutting_down` (a load balancer stops sending here; a client retries
at another API process), and the requests in flight go on for up to `shutdown_timeout_s`. Then the jobs this
process still streams are canceled (`Follower.end_all`): each client gets the 503 as its stream's last event or
as its answer, never a connection cut without a word, and its Idempotency-Key gets a fresh job on retry.
uvicorn meanwhile waits for the connections to close, then runs the lifespan's end, which ends whatever is left.

The server's own handler (uvicorn's, which stops accepting connections and waits for those open) is chained:
installed in the lifespan, this handler runs first, then that one. A process whose handler is the default (no
server installed one) or that is not on its main thread (a test client's portal) is left as it is."""

from __future__ import annotations

import logging
import signal
import threading
import time
from types import FrameType
from typing import Any

from prfaas.control_plane.jobs.generation import Follower

log = logging.getLogger(__name__)
SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Drain:
    """`begin` (the signal) starts the drain; `stop` (the lifespan's end) ends what is left."""

    def __init__(self, follower: Follower, timeout_s: float) -> None:
        self.follower = follower
        self.timeout_s = timeout_s
        self._begun = threading.Event()
        self._stopped = threading.Event()
        self.began_at: float | None = None
        self._thread = threading.Thread(target=self._run, name="prfaas-drain", daemon=True)
        self._thread.start()

    @property
    def draining(self) -> bool:
        return self._begun.is_set()

    def begin(self) -> None:
        """Safe in a signal handler: it sets an event; the drain's thread does the rest."""
        if not self._begun.is_set():
            self.began_at = time.monotonic()
            self._begun.set()

    def stop(self) -> None:
        """The server stopped serving: jobs still streamed here end now (none, after a drain that emptied)."""
        self._stopped.set()
        self._begun.set()
        self._thread.join(5.0)
        ended = self.follower.end_all()
        if ended:
            log.warning("shutdown: %d jobs still streamed here canceled", ended)

    def install_signals(self) -> list[int]:
        """Chain this drain before the server's handler of each of SIGNALS: -> the signals chained."""
        if threading.current_thread() is not threading.main_thread():
            return []
        chained: list[int] = []
        for sig in SIGNALS:
            previous = signal.getsignal(sig)
            if not callable(previous):  # SIG_DFL, SIG_IGN: no server drains here; ending the process is theirs
                continue
            signal.signal(sig, self._handler(previous))
            chained.append(sig)
        return chained

    def _handler(self, previous: Any) -> Any:
        def handle(signum: int, frame: FrameType | None) -> None:
            self.begin()
            previous(signum, frame)

        return handle

    def _run(self) -> None:
        self._begun.wait()
        if self._stopped.is_set():
            return
        log.warning("draining: %d jobs streamed here, new requests refused; those still running in %g s are "
                    "canceled", self.follower.streaming(), self.timeout_s)  # fmt: skip
        if self._stopped.wait(self.timeout_s):
            return
        ended = self.follower.end_all()
        log.warning("drain over after %g s: %d jobs still streamed here canceled", self.timeout_s, ended)
