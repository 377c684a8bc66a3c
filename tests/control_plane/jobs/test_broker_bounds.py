"""A dispatch queued on a broker that takes the connection and never answers (Redis stopped, a partition) fails
in seconds with kombu's OperationalError, which the API answers 503 and its job FAILED (api/completions.py).
Before, `enqueue` blocked for good: the request hung and its tenant's concurrency slot stayed taken."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import kombu.exceptions
import pytest
from cp_kit import cleanup, ensure_redis, make_settings

from prfaas.control_plane.jobs.celery_app import BROKER_TIMEOUT_S, enqueue, make_celery


@pytest.fixture
def silent_broker() -> Iterator[str]:
    """A redis:// URL whose server accepts every connection and never says a word."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    held: list[Any] = []

    def accept() -> None:
        while True:
            try:
                held.append(listener.accept())
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    yield f"redis://127.0.0.1:{listener.getsockname()[1]}/0"
    listener.close()
    for conn, _ in held:
        conn.close()


def test_a_dispatch_on_a_broker_that_never_answers_fails_in_seconds(silent_broker: str) -> None:
    ensure_redis()
    settings = make_settings()
    app = make_celery(settings)
    app.conf.broker_url = silent_broker
    outcome: list[Any] = []

    def send() -> None:
        try:
            enqueue(app, "job-1")
            outcome.append(None)
        except BaseException as exc:  # the test reads it
            outcome.append(exc)

    started = time.monotonic()
    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    sender.join(4 * BROKER_TIMEOUT_S)
    cleanup(settings)
    assert not sender.is_alive(), f"enqueue still blocked after {4 * BROKER_TIMEOUT_S:.0f} s"
    assert isinstance(outcome[0], kombu.exceptions.OperationalError), outcome
    assert time.monotonic() - started < 3 * BROKER_TIMEOUT_S
