"""prfaas.control_plane.tenants: who may call the API, with what limits.

Tenants, their API keys (SHA-256 digests only), quotas and budgets live in the control plane's database
beside the ledger (db/), so that nothing a tenant owns lives only in Redis; Redis caches them for the
request path and holds the hot counters (rate windows, concurrency, the month's spend: jobs/store.py,
billing/spend.py), all of which are rebuilt after Redis comes back empty. Reference: docs/control-plane.md.

    records.py   Tenant, Quota, Objectives, ApiKey, TenantChanges, the lookup errors, key digests
    models.py    the `tenants` and `api_keys` tables (migration 0003_tenants)
    cache.py     TenantCache: the Redis cache, one script call per authentication
    store.py     TenantStore: writes to the database then the cache; reads; authentication
"""

from prfaas.control_plane.tenants import records
from prfaas.control_plane.tenants.records import *  # noqa: F403  (its __all__: the records and lookup errors)
from prfaas.control_plane.tenants.store import TenantStore

__all__ = [*records.__all__, "TenantStore"]
