"""Helpers for the control-plane tests: settings with a key prefix of their own on the real
Redis at 127.0.0.1:6379 (tests/ensure-services.sh starts it), removed afterwards; and the
two-region stack of real processes the API's end-to-end tests run against."""

from __future__ import annotations

import socket
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import openai
import psycopg
import pytest
import redis

from prfaas.control_plane.fleet.registry import RegionRegistry
from prfaas.control_plane.services import Services
from prfaas.control_plane.settings import Settings
from prfaas.devstack.stack import ADMIN_KEY, REDIS_URL, TICKET_KEY, Stack, wait_until  # TICKET_KEY: region_kit.KEY
from prfaas.engine.models import prepare_model

__all__ = [
    "ADMIN_KEY",
    "REDIS_URL",
    "TICKET_KEY",
    "api_stack",
    "cleanup",
    "ensure_redis",
    "make_settings",
    "openai_client",
    "outcome_within",
    "postgres_database",
    "settings_fixture",
    "silent_port",
    "stack_services",
    "stack_settings",
    "two_region_stack",
]


def ensure_redis() -> None:
    script = Path(__file__).resolve().parents[1] / "ensure-services.sh"
    subprocess.run(["bash", str(script)], check=True, capture_output=True, timeout=30)


@contextmanager
def postgres_database() -> Iterator[str]:
    """A database of the caller's own on the PostgreSQL at 127.0.0.1:5432 (its SQLAlchemy URL), dropped after;
    the test is skipped where no PostgreSQL answers."""
    name = f"prfaas_test_{uuid.uuid4().hex[:8]}"
    admin = "postgresql://postgres@127.0.0.1:5432/test"
    try:
        with psycopg.connect(admin, autocommit=True, connect_timeout=5) as c:
            c.execute(f'CREATE DATABASE "{name}"')
    except psycopg.OperationalError as exc:
        pytest.skip(f"no PostgreSQL at 127.0.0.1:5432 ({exc})")
    try:
        yield f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}"
    finally:
        with psycopg.connect(admin, autocommit=True, connect_timeout=5) as c:
            c.execute(f'DROP DATABASE "{name}" WITH (FORCE)')


def make_settings(**overrides: object) -> Settings:
    """Settings of a test's own: a Redis key prefix and a database (tenants, ledger) in a SQLite file."""
    prefix = f"prfaas-test-{uuid.uuid4().hex[:12]}"
    fields: dict[str, object] = {
        "dev": True,
        "redis_url": REDIS_URL,
        "key_prefix": prefix,
        "admin_key": ADMIN_KEY,
        "ticket_key": TICKET_KEY,
        "ledger": {"url": f"sqlite:///{Path(tempfile.gettempdir()) / prefix}.db"},
    } | overrides
    return Settings(**fields)  # type: ignore[arg-type]


def stack_settings(stack: Stack, **overrides: object) -> Settings:
    """Settings on what `stack`'s processes use: its Redis key prefix and its database."""
    return make_settings(key_prefix=stack.prefix, ledger={"url": stack.ledger_url}, **overrides)


def cleanup(settings: Settings) -> None:
    client = redis.Redis.from_url(settings.redis_url)
    keys = list(client.scan_iter(f"{settings.key_prefix}:*", count=1000))
    if keys:
        client.delete(*keys)
    client.close()
    database = settings.ledger.url.removeprefix("sqlite:///")
    if settings.ledger.url.startswith("sqlite:///") and Path(database).name.startswith("prfaas-test-"):
        for leftover in Path(database).parent.glob(Path(database).name + "*"):  # the WAL, the migration lock
            leftover.unlink(missing_ok=True)


def settings_fixture(**overrides: object) -> Iterator[Settings]:
    ensure_redis()
    settings = make_settings(**overrides)
    yield settings
    cleanup(settings)


def services_fixture(**overrides: object) -> Iterator[Services]:
    """Services on settings of their own (`make_settings(**overrides)`), closed and cleaned up after."""
    for settings in settings_fixture(**overrides):
        services = Services.create(settings)
        yield services
        services.close()


def registry_fixture() -> Iterator[RegionRegistry]:
    """A region registry on settings of its own, cleaned up after."""
    for settings in settings_fixture():
        client = redis.Redis.from_url(settings.redis_url)
        yield RegionRegistry(client, settings)
        client.close()


def api_stack(folder: Path, **env: str) -> Iterator[Stack]:
    """The API process alone (uvicorn; `env` added to its environment): no Celery worker, no region, so a
    job it admits stays QUEUED until the test moves it or the API's deadline (`PRFAAS_JOB_TIMEOUT_S`)."""
    ensure_redis()
    prepare_model("tiny-llama")
    s = Stack(folder, **env)
    try:
        s.start_api()
        yield s
    finally:
        s.stop()
        s.cleanup()


def stack_services(stack: Stack) -> Iterator[Services]:
    """Services on `stack`'s Redis keys, for a test to read and write what its processes do."""
    s = Services.create(stack_settings(stack))
    yield s
    s.close()


def openai_client(stack: Stack, key: str, timeout_s: float = 60) -> openai.OpenAI:
    """The official client on `stack`'s API with tenant key `key`, no retries of its own."""
    return openai.OpenAI(base_url=stack.url + "/v1", api_key=key, max_retries=0, timeout=timeout_s)


def two_region_stack(
    folder: Path, *, env: dict[str, str] | None = None, worker_concurrency: int = 4,
    decode_fields: dict[str, Any] | None = None, **prefill_fields: Any,
) -> Iterator[Stack]:  # fmt: skip
    """The API (serving the registry), Celery worker `w1`, regions `prefill-a` ($0.5/GPU-h, `prefill_fields`
    added to its config) and `decode-b` ($4, `decode_fields` added), the link between them; yielded once both
    are healthy, stopped and removed after. `env`: settings of the control plane's processes (PRFAAS_*)."""
    ensure_redis()
    prepare_model("tiny-llama")
    s = Stack(folder, **(env or {}))
    try:
        s.start_api()
        s.start_worker("w1", worker_concurrency)
        s.region("prefill-a", "prefill", 0.5, **prefill_fields)
        s.region("decode-b", "decode", 4.0, **(decode_fields or {}))
        s.put_link("prefill-a", "decode-b")
        wait_until(lambda: len(s.healthy()) == 2, 20, 0.1)
        yield s
    finally:
        s.stop()
        s.cleanup()


def outcome_within(fn: Callable[[], Any], cutoff_s: float) -> tuple[BaseException | None, float]:
    """What `fn` raised (None: it returned) and how long it took, on a thread given `cutoff_s`: one still
    blocked then fails the test instead of hanging it (a daemon thread, left blocked)."""
    box: list[BaseException | None] = []

    def run() -> None:
        try:
            fn()
            box.append(None)
        except BaseException as exc:  # the test reads it
            box.append(exc)

    started = time.monotonic()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(cutoff_s)
    assert not thread.is_alive(), f"still blocked after {cutoff_s:.0f} s"
    return box[0], time.monotonic() - started


@contextmanager
def silent_port() -> Iterator[int]:
    """A local port that accepts every connection and never says a word (a stalled server)."""
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
    try:
        yield listener.getsockname()[1]
    finally:
        listener.close()
        for conn, _ in held:
            conn.close()
