"""One asyncio event loop per worker process, on a thread of its own, that holds the long calls
of every attempt the process started: the prefill regions' event streams (and reships). A
Celery task starts an attempt and returns; the stream is read here, so the jobs in flight are
bounded by the regions' queues, not by worker threads (one coroutine and one HTTP/2 stream per
job). Its channels are gRPC asyncio channels, one per (target, server name), made on the loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any

import grpc

from prfaas.region.channels import TlsFiles, aio_channel, keepalive_options

# A prefill region that hangs (stopped, a partition that drops without closing) breaks its event streams within
# this and an ack's wait: its attempt fails over in seconds. Before, the stream waited for its call's deadline
# (the lease + 5 s, 30 s at least) or the job's, with the decode region idle.
KEEPALIVE_S = 5.0


class Watcher:
    def __init__(self, tls: TlsFiles | None) -> None:
        self.tls = tls
        self.loop = asyncio.new_event_loop()
        self._channels: dict[tuple[str, str], grpc.aio.Channel] = {}
        self._running: set[concurrent.futures.Future[Any]] = set()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self.loop.run_forever, name="prfaas-watcher", daemon=True)
        self._thread.start()

    def submit(self, coroutine: Coroutine[Any, Any, Any]) -> concurrent.futures.Future[Any]:
        """Run `coroutine` on the loop (from any thread); returns at once."""
        future = asyncio.run_coroutine_threadsafe(coroutine, self.loop)
        with self._lock:
            self._running.add(future)
        future.add_done_callback(self._done)
        return future

    def _done(self, future: concurrent.futures.Future[Any]) -> None:
        with self._lock:
            self._running.discard(future)

    @property
    def in_flight(self) -> int:
        with self._lock:
            return len(self._running)

    def channel(self, target: str, server_name: str) -> grpc.aio.Channel:
        """On the loop only (a coroutine's body)."""
        found = self._channels.get((target, server_name))
        if found is None:
            options = keepalive_options(KEEPALIVE_S)
            found = self._channels[(target, server_name)] = aio_channel(target, self.tls, server_name, options)
        return found
