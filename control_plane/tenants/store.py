"""`TenantStore`: tenants, their API keys, quotas and budgets in the control plane's database (the one that
holds the ledger), with Redis as a cache in front of it for the request path (tenants/cache.py).

Every write goes to the database first, then through to the cache; a cache write that fails (Redis away) is
logged and the entry ages out within `tenant_cache_ttl_s`. Reads by operators (`get`, `all`, `list_keys`)
go to the database; `authenticate` (every request) asks the cache, and on a miss the database, whose answer
it caches where the cache still holds nothing (a revoke or update written through since that read stays;
`on_fill` runs for a tenant cached anew: the API raises its monthly spend in Redis to the
ledger's sum there, so a Redis restarted empty does not reset budgets). `warm` fills the cache at start,
running `on_fill` for each tenant too.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import redis
import redis.asyncio
from sqlalchemy import select
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session, sessionmaker

from prfaas.control_plane.settings import Settings
from prfaas.control_plane.tenants.cache import MISS, UNKNOWN_TTL_S, TenantCache
from prfaas.control_plane.tenants.models import ApiKeyRow, TenantRow
from prfaas.control_plane.tenants.records import (
    KEY_PREFIX,
    ApiKey,
    KeyNotFound,
    Objectives,
    Quota,
    Tenant,
    TenantChanges,
    TenantNotFound,
    TenantStatus,
    digest,
    well_formed,
)

log = logging.getLogger(__name__)


class TenantStore:
    def __init__(self, client: redis.Redis, settings: Settings, engine: Engine) -> None:
        self.settings = settings
        self.engine = engine
        self.cache = TenantCache(client, settings)
        self._sessions = sessionmaker(engine, expire_on_commit=False)
        self.on_fill: Callable[[Tenant], object] | None = None

    @contextmanager
    def _session(self) -> Iterator[Session]:
        with self._sessions.begin() as s:
            yield s

    # -- operators' writes: the database, then the cache -------------------------------------------------

    def create(self, name: str, limits: TenantChanges | None = None) -> Tenant:
        """A new active tenant; limits left None take the settings' defaults (`default.rps`, ...)."""
        s = self.settings
        now = time.time()
        fields = (
            {"status": TenantStatus.ACTIVE.value, "allow_placement": False, "rps": s.default.rps,
             "concurrency": s.default.concurrency, "budget_usd": s.default.budget_usd}
            | (limits or TenantChanges()).fields()
        )  # fmt: skip
        row = TenantRow(id="t-" + uuid.uuid4().hex[:16], name=name, created_at=now, updated_at=now, **fields)
        with self._session() as session:
            session.add(row)
        return _tenant(row)

    def update(self, tenant_id: str, changes: TenantChanges) -> Tenant:
        """Set what `changes` gives (None: unchanged). Raises TenantNotFound."""
        with self._session() as session:
            row = _tenant_row(session, tenant_id)
            for name, value in changes.fields().items():
                setattr(row, name, value)
            row.updated_at = time.time()
        tenant = _tenant(row)
        self._through("update", lambda: self.cache.put(tenant))
        return tenant

    def issue_key(self, tenant_id: str) -> tuple[ApiKey, str]:
        """A new key for `tenant_id`: the record and the full key (shown once, never stored)."""
        key_id = uuid.uuid4().hex[:12]
        full = f"{KEY_PREFIX}{key_id}-{secrets.token_urlsafe(24)}"
        with self._session() as session:
            _tenant_row(session, tenant_id)
            row = ApiKeyRow(id=key_id, tenant_id=tenant_id, digest=digest(full), revoked=False, created_at=time.time())
            session.add(row)
        return _key(row), full

    def revoke_key(self, tenant_id: str, key_id: str) -> ApiKey:
        """Revoke: refused by every API process at once (they share the cache). Raises KeyNotFound."""
        with self._session() as session:
            row = session.get(ApiKeyRow, key_id)
            if row is None or row.tenant_id != tenant_id:
                raise KeyNotFound(key_id)
            if not row.revoked:
                row.revoked, row.revoked_at = True, time.time()
        self._through("revoke", lambda: self.cache.deny(row.digest))
        return _key(row)

    def _through(self, what: str, write: Callable[[], None]) -> None:
        try:
            write()
        except redis.RedisError as exc:  # the database has it; the cache entry ages out (tenant_cache_ttl_s)
            log.warning("tenant cache not updated after %s (%s); stale for %d s at most", what, exc, self.cache.ttl_s)

    # -- operators' reads: the database -----------------------------------------------------------------

    def get(self, tenant_id: str) -> Tenant:
        with self._session() as session:
            return _tenant(_tenant_row(session, tenant_id))

    def all(self) -> list[Tenant]:
        with self._session() as session:
            return [_tenant(row) for row in session.scalars(select(TenantRow).order_by(TenantRow.id))]

    def get_key(self, key_id: str) -> ApiKey:
        with self._session() as session:
            row = session.get(ApiKeyRow, key_id)
            if row is None:
                raise KeyNotFound(key_id)
            return _key(row)

    def list_keys(self, tenant_id: str) -> list[ApiKey]:
        self.get(tenant_id)
        with self._session() as session:
            rows = session.scalars(select(ApiKeyRow).where(ApiKeyRow.tenant_id == tenant_id).order_by(ApiKeyRow.id))
            return [_key(row) for row in rows]

    # -- the request path: the cache, the database on a miss -----------------------------------------------

    def authenticate(self, presented: str) -> Tenant | None:
        """The tenant a presented key belongs to; None when unknown or revoked. One Redis call when cached.
        Raises redis.RedisError (the API answers 503)."""
        if not well_formed(presented):
            return None
        found = self.cache.lookup(presented)
        return self._fill(presented) if found is MISS else found  # type: ignore[return-value]

    def use_async(self, client: redis.asyncio.Redis | None) -> None:
        """The asyncio client `authenticate_async` calls (None: none); its connections belong to one event loop."""
        self.cache.use_async(client)

    async def authenticate_async(self, presented: str) -> Tenant | None:
        """`authenticate` on the event loop (the API's request path: no thread hop when cached); a miss reads
        the database on a thread. Without an asyncio client (`use_async`) it is the blocking call."""
        if not well_formed(presented):
            return None
        if not self.cache.has_async:
            return self.authenticate(presented)
        found = await self.cache.lookup_async(presented)
        if found is MISS:
            return await asyncio.to_thread(self._fill, presented)
        return found  # type: ignore[return-value]

    def _fill(self, presented: str) -> Tenant | None:
        """The database's answer for a key the cache does not know, cached."""
        key_digest = digest(presented)
        with self._session() as session:
            row = session.scalars(select(ApiKeyRow).where(ApiKeyRow.digest == key_digest)).one_or_none()
            tenant_row = None if row is None or row.revoked else session.get(TenantRow, row.tenant_id)
            tenant = None if tenant_row is None else _tenant(tenant_row)
        if tenant is None:
            self.cache.deny(key_digest, UNKNOWN_TTL_S if row is None else None)
            return None
        self.cache.fill(tenant, [key_digest])  # a revoke or suspension since the read above stays
        if self.on_fill is not None:
            self.on_fill(tenant)
        return tenant

    def warm(self) -> int:
        """Cache every tenant and unrevoked key not cached already (at start), each tenant after its `on_fill`
        (install it first); returns the keys read."""
        with self._session() as session:
            tenants = {row.id: _tenant(row) for row in session.scalars(select(TenantRow))}
            keys: dict[str, list[str]] = {}
            for row in session.scalars(select(ApiKeyRow).where(ApiKeyRow.revoked.is_(False))):
                keys.setdefault(row.tenant_id, []).append(row.digest)
        for tenant in tenants.values():
            # on_fill first: a tenant cached here is never `_fill`ed, so its budget would read as reset. If it raises,
            # warm stops with this tenant and the rest uncached: their first requests' fills run it again
            if self.on_fill is not None:
                self.on_fill(tenant)
            self.cache.fill(tenant, keys.get(tenant.id, []))
        return sum(len(k) for k in keys.values())


def _tenant_row(session: Session, tenant_id: str) -> TenantRow:
    row = session.get(TenantRow, tenant_id)
    if row is None:
        raise TenantNotFound(tenant_id)
    return row


def _tenant(row: TenantRow) -> Tenant:
    quota = Quota(rps=row.rps, concurrency=row.concurrency, budget_usd=row.budget_usd)
    objectives = Objectives(row.ttft_slo_ms, row.tpot_slo_ms, row.kv_codec)
    return Tenant(row.id, row.name, TenantStatus(row.status), quota, bool(row.allow_placement), row.created_at,
                  objectives)  # fmt: skip


def _key(row: ApiKeyRow) -> ApiKey:
    return ApiKey(row.id, row.tenant_id, bool(row.revoked), row.created_at)
