"""Helpers for the control-plane tests: settings with a key prefix of their own on the real
Redis at 127.0.0.1:6379 (tests/ensure-services.sh starts it), removed afterwards."""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import redis

from prfaas.control_plane.settings import Settings
from prfaas.devstack.stack import ADMIN_KEY, REDIS_URL, TICKET_KEY  # TICKET_KEY = tests/regions/region_kit.KEY

__all__ = ["ADMIN_KEY", "REDIS_URL", "TICKET_KEY", "cleanup", "ensure_redis", "make_settings", "settings_fixture"]


def ensure_redis() -> None:
    script = Path(__file__).resolve().parents[1] / "ensure-services.sh"
    subprocess.run(["bash", str(script)], check=True, capture_output=True, timeout=30)


def make_settings(**overrides: object) -> Settings:
    fields: dict[str, object] = {
        "dev": True,
        "redis_url": REDIS_URL,
        "key_prefix": f"prfaas-test-{uuid.uuid4().hex[:12]}",
        "admin_key": ADMIN_KEY,
        "ticket_key": TICKET_KEY,
    } | overrides
    return Settings(**fields)  # type: ignore[arg-type]


def cleanup(settings: Settings) -> None:
    client = redis.Redis.from_url(settings.redis_url)
    keys = list(client.scan_iter(f"{settings.key_prefix}:*", count=1000))
    if keys:
        client.delete(*keys)
    client.close()


def settings_fixture(**overrides: object) -> Iterator[Settings]:
    ensure_redis()
    settings = make_settings(**overrides)
    yield settings
    cleanup(settings)
