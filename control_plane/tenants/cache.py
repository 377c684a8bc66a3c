"""The Redis cache of tenants and API keys, in front of the database (tenants/store.py holds the truth).

Keys (prefix `p`), each expiring after `tenant_cache_ttl_s` so that a write-through that failed (Redis away
for a moment) is stale for that long at most:

    p:tenant:{id}          hash: the tenant (id, name, status, rps, concurrency, budget_usd, allow_placement,
                           created_at)
    p:keyhash:{digest}     the tenant id of an unrevoked key, or "!" for a revoked key (and, for
                           `UNKNOWN_TTL_S`, for a digest the database does not know)

Authentication is one script call: a miss (either key absent) sends the caller to the database, which fills
both keys; "!" refuses without it. Redis restarted empty is a miss for every key: tenants work again with
no operator.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import redis
import redis.asyncio

from prfaas.control_plane.settings import Settings
from prfaas.control_plane.tenants.records import Objectives, Quota, Tenant, TenantStatus, digest

DENIED = "!"
UNKNOWN_TTL_S = 5  # a digest the database does not know is refused this long without asking it again

# KEYS: keyhash; ARGV: the key prefix. nil: a miss (ask the database); {}: refused; else the tenant's hash, flat.
_AUTHENTICATE = """
local tenant = redis.call('GET', KEYS[1])
if not tenant then return false end
if tenant == '!' then return {} end
local fields = redis.call('HGETALL', ARGV[1] .. ':tenant:' .. tenant)
if #fields == 0 then return false end
return fields
"""

# KEYS: the tenant hash, then keyhash keys; ARGV: the TTL s, the tenant id, the hash's fields flat. What a
# database read fills in only where nothing is cached: a write that landed since the read (a revoke's "!",
# an update's hash) is newer than what the read saw and stays.
_FILL = """
local ttl = tonumber(ARGV[1])
if redis.call('EXISTS', KEYS[1]) == 0 then
  redis.call('HSET', KEYS[1], unpack(ARGV, 3))
  redis.call('EXPIRE', KEYS[1], ttl)
end
for i = 2, #KEYS do redis.call('SET', KEYS[i], ARGV[2], 'EX', ttl, 'NX') end
"""

MISS = object()  # what `lookup` returns when the cache does not know the key


class TenantCache:
    def __init__(self, client: redis.Redis, settings: Settings) -> None:
        # redis-py types every reply as `Awaitable | Any` (one stub for sync and async clients)
        self.redis: Any = client
        self.settings = settings
        self.ttl_s = max(1, round(settings.tenant_cache_ttl_s))
        self._authenticate = client.register_script(_AUTHENTICATE)
        self._fill = client.register_script(_FILL)
        self._async: Any = None  # (client, its script): `lookup_async`, on the API's event loop

    def use_async(self, client: redis.asyncio.Redis | None) -> None:
        """The asyncio client `lookup_async` calls (None: none); its connections belong to one event loop."""
        self._async = None if client is None else (client, client.register_script(_AUTHENTICATE))

    @property
    def has_async(self) -> bool:
        return self._async is not None

    def lookup(self, presented: str) -> Tenant | None | object:
        """The tenant of an unrevoked key; None: refused; MISS: ask the database. Raises redis.RedisError."""
        return _reply(self._authenticate(keys=self._keys(presented), args=[self.settings.key()]))

    async def lookup_async(self, presented: str) -> Tenant | None | object:
        """`lookup` with the asyncio client (see `use_async`)."""
        return _reply(await self._async[1](keys=self._keys(presented), args=[self.settings.key()]))

    def _keys(self, presented: str) -> list[str]:
        return [self.settings.key("keyhash", digest(presented))]

    def put(self, tenant: Tenant, key_digests: Sequence[str] = ()) -> None:
        """Cache `tenant` and, for each digest, that the key is its and unrevoked. Raises redis.RedisError."""
        with self.redis.pipeline(transaction=False) as pipe:
            pipe.hset(self.settings.key("tenant", tenant.id), mapping=_fields(tenant))
            pipe.expire(self.settings.key("tenant", tenant.id), self.ttl_s)
            for d in key_digests:
                pipe.set(self.settings.key("keyhash", d), tenant.id, ex=self.ttl_s)
            pipe.execute()

    def fill(self, tenant: Tenant, key_digests: Sequence[str] = ()) -> None:
        """`put` what a database read found, but only where the cache holds nothing: a revoke or an update
        written through since that read is newer and is kept. Raises redis.RedisError."""
        flat = [x for item in _fields(tenant).items() for x in item]
        keys = [self.settings.key("tenant", tenant.id), *(self.settings.key("keyhash", d) for d in key_digests)]
        self._fill(keys=keys, args=[self.ttl_s, tenant.id, *flat])

    def deny(self, key_digest: str, ttl_s: int | None = None) -> None:
        """Refuse this digest (revoked: for the cache's TTL; unknown: `ttl_s`)."""
        self.redis.set(self.settings.key("keyhash", key_digest), DENIED, ex=ttl_s or self.ttl_s)

    def forget(self, tenant_id: str) -> None:
        """Drop the cached tenant (the next request reads the database)."""
        self.redis.delete(self.settings.key("tenant", tenant_id))


def _fields(t: Tenant) -> dict[str, str | float | int]:
    return {
        "id": t.id, "name": t.name, "status": t.status.value, "rps": t.quota.rps,
        "concurrency": t.quota.concurrency, "budget_usd": t.quota.budget_usd,
        "allow_placement": int(t.allow_placement), "created_at": t.created_at,
        "ttft_slo_ms": _opt(t.objectives.ttft_slo_ms), "tpot_slo_ms": _opt(t.objectives.tpot_slo_ms),
        "kv_codec": t.objectives.kv_codec or "",
    }  # fmt: skip


def _opt(value: float | None) -> str:
    return "" if value is None else repr(value)


def _reply(reply: list[bytes] | None) -> Tenant | None | object:
    if reply is None:
        return MISS
    if not reply:
        return None
    raw = iter(reply)
    f = {k.decode(): v.decode() for k, v in zip(raw, raw, strict=True)}
    quota = Quota(rps=float(f["rps"]), concurrency=int(f["concurrency"]), budget_usd=float(f["budget_usd"]))
    objectives = Objectives(
        float(f["ttft_slo_ms"]) if f.get("ttft_slo_ms") else None,
        float(f["tpot_slo_ms"]) if f.get("tpot_slo_ms") else None,
        f.get("kv_codec") or None,
    )
    return Tenant(
        f["id"],
        f["name"],
        TenantStatus(f["status"]),
        quota,
        f["allow_placement"] == "1",
        float(f["created_at"]),
        objectives,
    )
