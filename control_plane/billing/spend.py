"""Each tenant's monthly spend in Redis (`p:tenant:{t}:spend:{YYYYMM}`, what the job store's admission
scripts check budgets against, with the $ reserved by jobs in flight: 402). Every new ledger entry settles
its job (`settle`: one script per tenant adds the entries' $ to the spend and ends their jobs'
reservations, so the budget never sees a job both reserved and spent, nor neither; one round trip for a
batch; into the month the job finished in, as the ledger counts it); the reconciliation sweep raises the
key to the ledger's sum for the month (`sync`: a set-if-greater script, so racing writers never lower it, and
a bill whose increment was lost in a crash is caught up; skipped while a biller is between its ledger write
and its settle, `settling`, so no entry is counted twice) and ends reservations left behind (`release`)."""

from __future__ import annotations

import contextlib
import datetime as dt
import time
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from prfaas.control_plane.jobs.scripts import RELEASE_RESERVATION_FN

if TYPE_CHECKING:
    from prfaas.control_plane.billing.ledger import Ledger
    from prfaas.control_plane.jobs.store import JobStore

SPEND_TTL_S = 40 * 86400  # a month's key outlives its month

# KEYS: spend, the tenant's settles under way. Set the spend key to ARGV[1] unless it already holds more (spend
# only rises within a month), or a biller is between its ledger write and its settle (KEYS[2] > 0): the sum
# read may hold an entry whose increment is still to come, and counting it here too would count it twice.
_RAISE_SPEND = """
local cur = tonumber(redis.call('GET', KEYS[1]) or '0')
if tonumber(redis.call('GET', KEYS[2]) or '0') > 0 then return tostring(cur) end
if tonumber(ARGV[1]) > cur then redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2]) end
return tostring(math.max(cur, tonumber(ARGV[1])))
"""
SETTLING_TTL_S = 120  # a biller that died between its ledger write and its settle holds no sync off for longer

# KEYS: spend, reservations hash, their sum. ARGV: $ billed, TTL of the spend key, then the billed jobs' ids:
# the $ joins the spend and each job's reservation ends, in one step.
_SETTLE = (
    RELEASE_RESERVATION_FN
    + """
redis.call('INCRBYFLOAT', KEYS[1], ARGV[1])
redis.call('EXPIRE', KEYS[1], ARGV[2])
for i = 3, #ARGV do release_reservation(KEYS[2], KEYS[3], ARGV[i]) end
return 1
"""
)

# KEYS: reservations hash, their sum. ARGV: job ids. Ends those reservations; returns how many it ended.
_RELEASE = (
    RELEASE_RESERVATION_FN
    + """
local n = 0
for i = 1, #ARGV do n = n + release_reservation(KEYS[1], KEYS[2], ARGV[i]) end
return n
"""
)


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
        self._settle = client.register_script(_SETTLE)
        self._release = client.register_script(_RELEASE)

    @contextlib.contextmanager
    def settling(self, tenants: Iterable[str]) -> Iterator[None]:
        """Around a biller's ledger write and its `settle`: while any is under way, `sync` leaves the tenant's
        spend as it is (its sum could count an entry the settle is about to add)."""
        keys = [self._settling_key(t) for t in sorted(set(tenants))]
        if keys:
            with self.redis.pipeline(transaction=False) as pipe:
                for key in keys:
                    pipe.incr(key)
                    pipe.expire(key, SETTLING_TTL_S)
                pipe.execute()
        try:
            yield
        finally:
            if keys:
                with self.redis.pipeline(transaction=False) as pipe:
                    for key in keys:
                        pipe.decr(key)
                    pipe.execute()

    def settle(self, billed: Iterable[tuple[str, str, float, dt.datetime]]) -> None:
        """Newly written entries, (tenant, job id, $, finished at (UTC)) each: add their $ to each tenant's spend of
        the month the job finished in (the month the ledger counts it in) and end their jobs' reservations
        (actual replaces reserved), atomically per tenant and month, in one round trip."""
        by_key: dict[tuple[str, str], tuple[float, list[str]]] = {}
        for tenant, job_id, usd, finished_at in billed:
            key = (tenant, self.jobs.spend_key(tenant, _epoch(finished_at)))
            total, ids = by_key.get(key, (0.0, []))
            by_key[key] = (total + usd, [*ids, job_id])
        if not by_key:
            return
        with self.redis.pipeline(transaction=False) as pipe:
            for (tenant, spend_key), (usd, ids) in by_key.items():
                keys = [spend_key, *self.jobs.reservation_keys(tenant)]
                self._settle(keys=keys, args=[repr(usd), SPEND_TTL_S, *ids], client=pipe)
            pipe.execute()

    def _settling_key(self, tenant: str) -> str:
        return str(self.jobs.settings.key("tenant", tenant, "settling"))

    def reservations(self, tenant: str) -> dict[str, float]:
        """Job id -> $ reserved, for the tenant's jobs admitted and not yet billed or ended."""
        raw = self.redis.hgetall(self.jobs.reservation_keys(tenant)[0])
        return {(k.decode() if isinstance(k, bytes) else str(k)): float(v) for k, v in raw.items()}

    def release(self, tenant: str, job_ids: list[str]) -> int:
        """End these jobs' reservations (without spend); returns how many were still held."""
        if not job_ids:
            return 0
        return int(self._release(keys=list(self.jobs.reservation_keys(tenant)), args=job_ids))

    def sync(self, tenant: str, ledger: Ledger) -> float:
        """Raise the tenant's monthly spend to the ledger's sum for the month (unless a biller is between its write
        and its settle: the next sweep does it); returns the spend now."""
        now = time.time()  # one clock read: the month summed is the month whose key is raised
        start, end = month_window(now)
        total = ledger.spend(tenant, start, end)
        keys = [self.jobs.spend_key(tenant, now), self._settling_key(tenant)]
        return float(self._raise_spend(keys=keys, args=[repr(total), SPEND_TTL_S]))


def _epoch(t: dt.datetime) -> float:
    """A ledger time (UTC, naive or aware) as epoch seconds."""
    return (t if t.tzinfo is not None else t.replace(tzinfo=dt.UTC)).timestamp()
