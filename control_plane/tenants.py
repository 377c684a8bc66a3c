"""Tenants and API keys in Redis. A key is `pfk-<key id>-<secret>`; only its SHA-256 is
stored (keys are 192-bit random, so a fast hash is enough), and the full key is returned
once, at issue. Revoking marks the key; a revoked or unknown key authenticates nobody.

Keys (prefix `p`): `p:tenant:{id}` hash, `p:tenants` set, `p:tenant:{id}:keys` set of key
ids, `p:key:{key id}` hash (digest, tenant, revoked, created_at), `p:keyhash:{digest}` -> key id.
"""

from __future__ import annotations

import dataclasses
import hashlib
import secrets
import time
import uuid
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import redis
import redis.asyncio

from prfaas.control_plane.settings import Settings

KEY_PREFIX = "pfk-"


class TenantStatus(StrEnum):
    ACTIVE = "active"
    SUSPENDED = "suspended"


@dataclass(frozen=True)
class Quota:
    """A tenant's admission limits (checked by the job store's admission script): requests per second,
    concurrent jobs, and $ per calendar month."""

    rps: float
    concurrency: int
    budget_usd: float


class TenantNotFound(Exception):
    pass


class KeyNotFound(Exception):
    pass


@dataclass(frozen=True)
class Tenant:
    id: str
    name: str
    status: TenantStatus
    quota: Quota
    allow_placement: bool  # may requests ask for their placement (local / split)
    created_at: float


@dataclass(frozen=True)
class TenantChanges:
    """What an operator sets on a tenant (`TenantStore.create`, `update`); None leaves a field as it is."""

    status: TenantStatus | None = None
    rps: float | None = None
    concurrency: int | None = None
    budget_usd: float | None = None
    allow_placement: bool | None = None

    def fields(self) -> dict[str, str | float | int]:
        """The tenant hash's fields these changes set."""
        values = dataclasses.asdict(self) | {
            "status": None if self.status is None else self.status.value,
            "allow_placement": None if self.allow_placement is None else int(self.allow_placement),
        }
        return {name: value for name, value in values.items() if value is not None}


@dataclass(frozen=True)
class ApiKey:
    id: str
    tenant: str
    revoked: bool
    created_at: float


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


# KEYS: keyhash; ARGV: the key prefix. The tenant's hash of an unrevoked key, flat; {} otherwise.
_AUTHENTICATE = """
local key_id = redis.call('GET', KEYS[1])
if not key_id then return {} end
local key = redis.call('HMGET', ARGV[1] .. ':key:' .. key_id, 'tenant', 'revoked')
if not key[1] or key[2] == '1' then return {} end
return redis.call('HGETALL', ARGV[1] .. ':tenant:' .. key[1])
"""


def _tenant(f: dict[str, str]) -> Tenant:
    quota = Quota(rps=float(f["rps"]), concurrency=int(f["concurrency"]), budget_usd=float(f["budget_usd"]))
    return Tenant(
        f["id"], f["name"], TenantStatus(f["status"]), quota, f["allow_placement"] == "1", float(f["created_at"])
    )


class TenantStore:
    def __init__(self, client: redis.Redis, settings: Settings) -> None:
        # redis-py types every reply as `Awaitable | Any` (one stub for sync and async clients)
        self.redis: Any = client
        self.settings = settings
        self._authenticate = client.register_script(_AUTHENTICATE)
        self._async: Any = None  # (client, its script): `authenticate_async`, on the API's event loop

    def create(self, name: str, limits: TenantChanges | None = None) -> Tenant:
        """A new active tenant; limits left None take the settings' defaults (`default_rps`, ...)."""
        s = self.settings
        tenant_id = "t-" + uuid.uuid4().hex[:16]
        defaults = {"rps": s.default_rps, "concurrency": s.default_concurrency, "budget_usd": s.default_budget_usd}
        fields = (
            {"id": tenant_id, "name": name, "status": TenantStatus.ACTIVE.value, "allow_placement": 0}
            | defaults
            | (limits or TenantChanges()).fields()
            | {"created_at": time.time()}
        )
        with self.redis.pipeline() as pipe:
            pipe.hset(s.key("tenant", tenant_id), mapping=fields)
            pipe.sadd(s.key("tenants"), tenant_id)
            pipe.execute()
        return self.get(tenant_id)

    def get(self, tenant_id: str) -> Tenant:
        raw = self.redis.hgetall(self.settings.key("tenant", tenant_id))
        if not raw:
            raise TenantNotFound(tenant_id)
        return _tenant({k.decode(): v.decode() for k, v in raw.items()})

    def all(self) -> list[Tenant]:
        ids = sorted(m.decode() for m in self.redis.smembers(self.settings.key("tenants")))
        return [self.get(tenant_id) for tenant_id in ids]

    def update(self, tenant_id: str, changes: TenantChanges) -> Tenant:
        """Set what `changes` gives (None: unchanged). Raises TenantNotFound."""
        self.get(tenant_id)
        fields = changes.fields()
        if fields:
            self.redis.hset(self.settings.key("tenant", tenant_id), mapping=fields)
        return self.get(tenant_id)

    def issue_key(self, tenant_id: str) -> tuple[ApiKey, str]:
        """A new key for `tenant_id`: the record and the full key (shown once, never stored)."""
        self.get(tenant_id)
        key_id = uuid.uuid4().hex[:12]
        full = f"{KEY_PREFIX}{key_id}-{secrets.token_urlsafe(24)}"
        s = self.settings
        record = {"id": key_id, "tenant": tenant_id, "digest": digest(full), "revoked": 0, "created_at": time.time()}
        with self.redis.pipeline() as pipe:
            pipe.hset(s.key("key", key_id), mapping=record)
            pipe.set(s.key("keyhash", digest(full)), key_id)
            pipe.sadd(s.key("tenant", tenant_id, "keys"), key_id)
            pipe.execute()
        return self.get_key(key_id), full

    def get_key(self, key_id: str) -> ApiKey:
        raw = self.redis.hgetall(self.settings.key("key", key_id))
        if not raw:
            raise KeyNotFound(key_id)
        f = {k.decode(): v.decode() for k, v in raw.items()}
        return ApiKey(f["id"], f["tenant"], f["revoked"] == "1", float(f["created_at"]))

    def list_keys(self, tenant_id: str) -> list[ApiKey]:
        self.get(tenant_id)
        ids = sorted(m.decode() for m in self.redis.smembers(self.settings.key("tenant", tenant_id, "keys")))
        return [self.get_key(key_id) for key_id in ids]

    def revoke_key(self, tenant_id: str, key_id: str) -> ApiKey:
        key = self.get_key(key_id)
        if key.tenant != tenant_id:
            raise KeyNotFound(key_id)
        self.redis.hset(self.settings.key("key", key_id), "revoked", 1)
        return self.get_key(key_id)

    def authenticate(self, presented: str) -> Tenant | None:
        """The tenant a presented key belongs to; None when unknown or revoked. One Redis call."""
        if not _well_formed(presented):
            return None
        return _found(self._authenticate(keys=self._auth_keys(presented), args=[self.settings.key()]))

    def use_async(self, client: redis.asyncio.Redis | None) -> None:
        """The asyncio client `authenticate_async` calls (None: none); its connections belong to one event loop."""
        self._async = None if client is None else (client, client.register_script(_AUTHENTICATE))

    async def authenticate_async(self, presented: str) -> Tenant | None:
        """`authenticate` on the event loop (the API's request path: no thread hop for it); the same script.
        Without an asyncio client (`use_async`) it is the blocking call."""
        if not _well_formed(presented):
            return None
        if self._async is None:
            return self.authenticate(presented)
        return _found(await self._async[1](keys=self._auth_keys(presented), args=[self.settings.key()]))

    def _auth_keys(self, presented: str) -> list[str]:
        return [self.settings.key("keyhash", digest(presented))]


def _well_formed(presented: str) -> bool:
    return presented.startswith(KEY_PREFIX) and len(presented) <= 128


def _found(reply: list[bytes] | None) -> Tenant | None:
    if not reply:
        return None
    raw = iter(reply)
    return _tenant({k.decode(): v.decode() for k, v in zip(raw, raw, strict=True)})
