"""Each tenant's monthly spend in Redis (`p:tenant:{t}:spend:{YYYYMM}`, the key the job store's admission
script checks budgets against: 402). Every new ledger entry adds its $ (`add`: O(1) a job, one round trip
for a batch); the reconciliation sweep raises the key to the ledger's sum for the month (`sync`: a
set-if-greater script, so racing writers never lower it, and a bill whose increment was lost in a crash
is caught up)."""

from __future__ import annotations

import datetime as dt
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from prfaas.control_plane.billing.ledger import Ledger
    from prfaas.control_plane.jobs.store import JobStore

SPEND_TTL_S = 40 * 86400  # a month's key outlives its month

# Set the spend key to ARGV[1] unless it already holds more (spend only rises within a month).
_RAISE_SPEND = """
local cur = tonumber(redis.call('GET', KEYS[1]) or '0')
if tonumber(ARGV[1]) > cur then redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2]) end
return tostring(math.max(cur, tonumber(ARGV[1])))
"""


def month_window(now: float | None = None) -> tuple[dt.datetime, dt.datetime]:
    """[start, end) of the UTC calendar month holding `now` (epoch s; None: now)."""
    t = dt.datetime.fromtimestamp(time.time() if now is None else now, dt.UTC)
    start = t.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    end = (start + dt.timedelta(days=32)).replace(day=1)
    return start, end


class TenantSpend:
    def __init__(self, client: Any, jobs: JobStore) -> None:
        self.redis: Any = client
        self.jobs = jobs
        self._raise_spend = client.register_script(_RAISE_SPEND)

    def add(self, usd_by_tenant: dict[str, float]) -> None:
        """Add newly written entries' $ to each tenant's monthly spend, in one round trip."""
        if not usd_by_tenant:
            return
        with self.redis.pipeline() as pipe:
            for tenant, usd in usd_by_tenant.items():
                key = self.jobs.spend_key(tenant)
                pipe.incrbyfloat(key, usd)
                pipe.expire(key, SPEND_TTL_S)
            pipe.execute()

    def sync(self, tenant: str, ledger: Ledger) -> float:
        """Raise the tenant's monthly spend to the ledger's sum for the month; returns the spend now."""
        start, end = month_window()
        total = ledger.spend(tenant, start, end)
        return float(self._raise_spend(keys=[self.jobs.spend_key(tenant)], args=[repr(total), SPEND_TTL_S]))
