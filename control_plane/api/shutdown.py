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
POLL_S = 0.1  # how soon the drain's thread sees the signal


class Drain:
    """`begin` (the signal) starts the drain; `stop` (the lifespan's end) ends what is left."""

    def __init__(self, follower: Follower, timeout_s: float) -> None:
        self.follower = follower
        self.timeout_s = timeout_s
        self.began_at: float | None = None  # set by the signal handler: a plain attribute, no lock to take there
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="prfaas-drain", daemon=True)
        self._thread.start()

    @property
    def draining(self) -> bool:
        return self.began_at is not None

    def begin(self) -> None:
        """Safe in a signal handler (it takes no lock: an Event's would deadlock with the main thread inside its
        own `set`); the drain's thread sees it within POLL_S and does the rest."""
        if self.began_at is None:
            self.began_at = time.monotonic()

    def stop(self) -> None:
        """The server stopped serving: jobs still streamed here end now (none, after a drain that emptied)."""
        self._stopped.set()
        self._thread.join(5.0)
        try:
            ended = self.follower.end_all()
        except Exception:  # the lifespan's end goes on (the registry, the beats, the meter)
            log.exception("shutdown: ending the jobs still streamed here failed")
            return
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
        while self.began_at is None:
            if self._stopped.wait(POLL_S):
                return
        log.warning("draining: %d jobs streamed here, new requests refused; those still running in %g s are "
                    "canceled", self.follower.streaming(), self.timeout_s)  # fmt: skip
        if self._stopped.wait(self.timeout_s):
            return
        try:
            ended = self.follower.end_all()
        except Exception:  # the lifespan's end tries again
            log.exception("drain over after %g s: ending the jobs still streamed here failed", self.timeout_s)
            return
        log.warning("drain over after %g s: %d jobs still streamed here canceled", self.timeout_s, ended)
