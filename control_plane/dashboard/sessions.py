"""Dashboard sessions in Redis. The browser holds a random 256-bit token (cookie `prfaas_session`, HttpOnly,
SameSite=Strict, Secure over HTTPS); Redis holds `p:dash:session:{sha256(token)}` (who, the API key id it
signed in with, its CSRF token; expires after `SESSION_TTL_S`). Signing out deletes the record, so a copied
cookie is dead too. A tenant session also ends when its key is revoked or the tenant suspended; an admin
session when the control plane's admin key is no longer the one it signed in with.

CSRF: every form carries a token checked against the session's (sign-out), or, before there is a session
(sign-in), against a random `prfaas_csrf` cookie set with the form (double submit; SameSite=Strict)."""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from dataclasses import dataclass
from typing import Any

SESSION_COOKIE = "prfaas_session"
CSRF_COOKIE = "prfaas_csrf"
SESSION_TTL_S = 8 * 3600


@dataclass(frozen=True)
class Session:
    kind: str  # "tenant" or "admin"
    tenant: str  # "" for admin
    key_id: str  # the API key's id; for admin, a digest of the admin key (routes._admin_key_id)
    csrf: str
    created_at: float


class SessionStore:
    def __init__(self, client: Any, prefix: str) -> None:
        self.redis: Any = client
        self.prefix = prefix

    def _key(self, token: str) -> str:
        return f"{self.prefix}:dash:session:{hashlib.sha256(token.encode()).hexdigest()}"

    def create(self, kind: str, tenant: str = "", key_id: str = "") -> tuple[str, Session]:
        token = secrets.token_urlsafe(32)
        session = Session(kind, tenant, key_id, secrets.token_urlsafe(32), time.time())
        fields = {"kind": kind, "tenant": tenant, "key_id": key_id, "csrf": session.csrf, "at": session.created_at}
        with self.redis.pipeline() as pipe:
            pipe.hset(self._key(token), mapping=fields)
            pipe.expire(self._key(token), SESSION_TTL_S)
            pipe.execute()
        return token, session

    def get(self, token: str | None) -> Session | None:
        if not token or len(token) > 128:
            return None
        raw = self.redis.hgetall(self._key(token))
        if not raw:
            return None
        f = {k.decode(): v.decode() for k, v in raw.items()}
        return Session(f["kind"], f["tenant"], f["key_id"], f["csrf"], float(f["at"]))

    def delete(self, token: str | None) -> None:
        if token and len(token) <= 128:
            self.redis.delete(self._key(token))


def same(a: str | None, b: str | None) -> bool:
    return bool(a) and bool(b) and hmac.compare_digest(str(a).encode(), str(b).encode())
