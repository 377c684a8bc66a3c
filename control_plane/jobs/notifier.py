"""Wake-ups for `JobStore.wait_ready`: one pattern subscription per process to the jobs' notify channels
(`p:job:{id}:notify`; `post_ready` and terminal moves publish there), so a waiter blocks instead of polling."""

from __future__ import annotations

import threading
import time
from typing import Any

import redis


class Notifier:
    """One pattern subscription per process (`{prefix}:job:*:notify`), started at the first
    `watch`: a thread wakes the `wait_ready` callers of a job when its channel gets a message.
    Every API process gets every notice, so any of them may follow a job. When the
    subscription breaks it wakes every waiter (a notice may have been lost), and `live` is
    False until it is back: waiters then poll."""

    def __init__(self, client: redis.Redis, pattern: str) -> None:
        self._client: Any = client  # redis-py's `pubsub` is untyped
        self._pattern = pattern
        self._lock = threading.Lock()
        self._waiters: dict[str, set[threading.Event]] = {}
        self._live = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def live(self) -> bool:
        return self._live.is_set()

    def watch(self, channel: str) -> threading.Event:
        """An event set at each notice on `channel`; once `live`, no notice published after this returns is missed."""
        event = threading.Event()
        with self._lock:
            self._waiters.setdefault(channel, set()).add(event)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="job-notify", daemon=True)
                self._thread.start()
        self._live.wait(1.0)
        return event

    def unwatch(self, channel: str, event: threading.Event) -> None:
        with self._lock:
            events = self._waiters.get(channel)
            if events is not None:
                events.discard(event)
                if not events:
                    del self._waiters[channel]

    def _wake(self, channel: str | None) -> None:
        with self._lock:
            if channel is None:
                events = [e for group in self._waiters.values() for e in group]
            else:
                events = list(self._waiters.get(channel, ()))
        for event in events:
            event.set()

    def _run(self) -> None:
        while True:
            pubsub = self._client.pubsub()
            try:
                pubsub.psubscribe(self._pattern)
                while True:
                    message = pubsub.get_message(timeout=1.0)
                    if message is None:
                        continue
                    if message["type"] == "psubscribe":
                        self._live.set()
                        self._wake(None)  # notices of the gap before (re)subscribing are lost: re-read
                    elif message["type"] == "pmessage":
                        self._wake(_text(message["channel"]))
            except (redis.RedisError, OSError, ValueError):  # ValueError: the pool closed the socket under us
                self._live.clear()
                self._wake(None)
                time.sleep(0.1)
            finally:
                pubsub.close()


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
