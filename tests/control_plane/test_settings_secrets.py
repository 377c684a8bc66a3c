"""The control plane refuses placeholder secrets, and accepts every random key `prfaas up` makes."""

from __future__ import annotations

import secrets

import pytest
from pydantic import ValidationError

from prfaas.control_plane.settings import Settings

GOOD = "k" + secrets.token_urlsafe(32)


@pytest.mark.parametrize("key", ["change-me-" + "a1b2c3d4" * 4, "x" * 40, "ab" * 20, "short-but-random-9f3"])
def test_a_placeholder_ticket_key_is_refused(key: str) -> None:
    with pytest.raises(ValidationError, match="looks like a placeholder"):
        Settings(admin_key=GOOD, ticket_key=key, dev=False)


def test_a_random_key_with_xxx_in_it_is_a_key() -> None:
    key = "Qm3xXxv9" + secrets.token_urlsafe(32)  # 1 in ~800 url-safe tokens holds "xxx" (any case)
    assert Settings(admin_key=GOOD, ticket_key=key, dev=False).ticket_key.get_secret_value() == key
    for _ in range(2000):  # what `prfaas up` generates is never refused
        Settings(admin_key=secrets.token_urlsafe(32), ticket_key=secrets.token_urlsafe(32), dev=False)
