"""A dispatch queued on a broker that takes the connection and never answers (Redis stopped, a partition) fails
in seconds with kombu's OperationalError, which the API answers 503 and its job FAILED (api/completions.py).
Before, `enqueue` blocked for good: the request hung and its tenant's concurrency slot stayed taken."""

from __future__ import annotations

from collections.abc import Iterator

import kombu.exceptions
import pytest
from cp_kit import cleanup, ensure_redis, make_settings, outcome_within, silent_port

from prfaas.control_plane.jobs.celery_app import BROKER_TIMEOUT_S, enqueue, make_celery


@pytest.fixture
def silent_broker() -> Iterator[str]:
    """A redis:// URL whose server accepts every connection and never says a word."""
    with silent_port() as port:
        yield f"redis://127.0.0.1:{port}/0"


def test_a_dispatch_on_a_broker_that_never_answers_fails_in_seconds(silent_broker: str) -> None:
    ensure_redis()
    settings = make_settings()
    app = make_celery(settings)
    app.conf.broker_url = silent_broker
    try:
        error, took_s = outcome_within(lambda: enqueue(app, "job-1"), 4 * BROKER_TIMEOUT_S)
    finally:
        cleanup(settings)
    assert isinstance(error, kombu.exceptions.OperationalError), error
    assert took_s < 3 * BROKER_TIMEOUT_S
