"""Each tenant's monthly spend in Redis (`p:tenant:{t}:spend:{YYYYMM}`, what the job store's admission
scripts check budgets against, with the $ reserved by jobs in flight: 402). Every new ledger entry settles
its job (`settle`: one script per tenant adds the entries' $ to the spend and ends their jobs'
reservations, so the budget never sees a job both reserved and spent, nor neither; one round trip for a
batch; into the month the job finished in, as the ledger counts it); the reconciliation sweep raises the
key to the ledger's sum for the month (`sync`: a set-if-greater script, so racing writers never lower it, and
a bill whose increment was lost in a crash is caught up) and ends reservations left behind (`release`).

A biller holds a lease on each of its tenants from before its ledger write until after its settle
(`settling`, `SETTLING_TTL_S` long, in `p:tenant:{t}:settle_leases`: lease id -> deadline on Redis's clock).
While a live lease is held the sync leaves the spend as it is (its sum may hold an entry whose settle is still
to come); a settle whose own lease has run out adds nothing (a sync may have counted its entries already:
the biller counts them with a sync of its own instead). So every entry is counted once, and a biller lost
between its write and its settle holds the sync off for one lease, however often the tenant is billed."""

from __future__ import annotations

import contextlib
import datetime as dt
import time
import uuid
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from prfaas.control_plane.jobs.scripts import RELEASE_RESERVATION_FN

if TYPE_CHECKING:
    from prfaas.control_plane.billing.ledger import Ledger
    from prfaas.control_plane.jobs.store import JobStore

SPEND_TTL_S = 40 * 86400  # a month's key outlives its month

SETTLING_TTL_S = 120  # a settle lease's life (s): the longest a biller may take from its ledger write to its settle

# Lua function: drop the settle leases whose deadline (epoch s) has passed, on Redis's clock.
_DROP_EXPIRED_FN = """
local function drop_expired(leases)
  local t = redis.call('TIME')
  redis.call('ZREMRANGEBYSCORE', leases, '-inf', tonumber(t[1]) + tonumber(t[2]) / 1000000)
end
"""

# KEYS: the tenant's settle leases. ARGV: lease id, its life (s). The key outlives the newest lease by a second.
_ENTER = """
local t = redis.call('TIME')
redis.call('ZADD', KEYS[1], tonumber(t[1]) + tonumber(t[2]) / 1000000 + tonumber(ARGV[2]), ARGV[1])
redis.call('EXPIRE', KEYS[1], tonumber(ARGV[2]) + 1)
return 1
"""

# KEYS: spend, the tenant's settle leases. Set the spend key to ARGV[1] unless it already holds more (spend only
# rises within a month), or a live lease is held (the sum read may hold an entry whose increment is still to come,
# and counting it here too would count it twice). Returns 1 when it ran, 0 when held off.
_RAISE_SPEND = (
    _DROP_EXPIRED_FN
    + """
drop_expired(KEYS[2])
if redis.call('ZCARD', KEYS[2]) > 0 then return 0 end
if tonumber(ARGV[1]) > tonumber(redis.call('GET', KEYS[1]) or '0') then
  redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
end
return 1
"""
)

# KEYS: spend, reservations hash, their sum, the tenant's settle leases. ARGV: $ billed, TTL of the spend key, the
# biller's lease, then the billed jobs' ids: the $ joins the spend and each job's reservation ends, in one step;
# only while the lease is live (0 when it ran out: nothing done, as a sync may have counted the $ since).
_SETTLE = (
    RELEASE_RESERVATION_FN
    + _DROP_EXPIRED_FN
    + """
drop_expired(KEYS[4])
if not redis.call('ZSCORE', KEYS[4], ARGV[3]) then return 0 end
redis.call('INCRBYFLOAT', KEYS[1], ARGV[1])
redis.call('EXPIRE', KEYS[1], ARGV[2])
for i = 4, #ARGV do release_reservation(KEYS[2], KEYS[3], ARGV[i]) end
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
        self._enter = client.register_script(_ENTER)
        self._raise_spend = client.register_script(_RAISE_SPEND)
        self._settle = client.register_script(_SETTLE)
        self._release = client.register_script(_RELEASE)

    @contextlib.contextmanager
    def settling(self, tenants: Iterable[str]) -> Iterator[str]:
        """Around a biller's ledger write and its `settle`: a lease on each tenant's spend, `SETTLING_TTL_S` long;
        yields its id, for `settle`. While it is live, `sync` leaves those tenants' spend as it is (its sum could
        count an entry the settle is about to add); once it has run out (the biller lost or stalled), it holds no
        sync off, and the settle adds nothing."""
        lease = uuid.uuid4().hex
        keys = [self._leases_key(t) for t in sorted(set(tenants))]
        if keys:
            with self.redis.pipeline(transaction=False) as pipe:
                for key in keys:
                    self._enter(keys=[key], args=[lease, SETTLING_TTL_S], client=pipe)
                pipe.execute()
        try:
            yield lease
        finally:
            if keys:  # lost (a crash, Redis away): the lease runs out at its deadline all the same
                with self.redis.pipeline(transaction=False) as pipe:
                    for key in keys:
                        pipe.zrem(key, lease)
                    pipe.execute()

    def settle(self, billed: Iterable[tuple[str, str, float, dt.datetime]], lease: str) -> dict[str, list[str]]:
        """Newly written entries, (tenant, job id, $, finished at (UTC)) each, under `lease` (from `settling`): add
        their $ to each tenant's spend of the month the job finished in (the month the ledger counts it in) and end
        their jobs' reservations (actual replaces reserved), atomically per tenant and month, in one round trip.
        Returns tenant -> job ids of the entries left alone because the lease had run out by then (a stall): the
        caller counts them with `catch_up`."""
        by_key: dict[tuple[str, str], tuple[float, list[str]]] = {}
        for tenant, job_id, usd, finished_at in billed:
            key = (tenant, self.jobs.spend_key(tenant, _epoch(finished_at)))
            total, ids = by_key.get(key, (0.0, []))
            by_key[key] = (total + usd, [*ids, job_id])
        if not by_key:
            return {}
        with self.redis.pipeline(transaction=False) as pipe:
            for (tenant, spend_key), (usd, ids) in by_key.items():
                keys = [spend_key, *self.jobs.reservation_keys(tenant), self._leases_key(tenant)]
                self._settle(keys=keys, args=[repr(usd), SPEND_TTL_S, lease, *ids], client=pipe)
            done = pipe.execute()
        late: dict[str, list[str]] = {}
        for ((tenant, _), (_, ids)), settled in zip(by_key.items(), done, strict=True):
            if not int(settled):
                late.setdefault(tenant, []).extend(ids)
        return late

    def catch_up(self, tenant: str, ledger: Ledger, late: dict[str, dt.datetime]) -> bool:
        """Count entries whose settle came too late (`settle`'s answer for the tenant; job id -> finished at (UTC)):
        sync the tenant's spend of each month they finished in (the month the ledger counts them in, not always
        this one), and then end their jobs' reservations. False (a month's left alone) while another biller's
        lease holds the sync off: the reconciliation sweep does both later."""
        by_month: dict[float, list[str]] = {}
        for job_id, finished_at in late.items():
            by_month.setdefault(month_window(_epoch(finished_at))[0].timestamp(), []).append(job_id)
        synced = True
        for month, job_ids in by_month.items():
            if self.sync(tenant, ledger, month):
                self.release(tenant, job_ids)
            else:
                synced = False
        return synced

    def _leases_key(self, tenant: str) -> str:
        # a zset; the name is new (older versions kept a string counter at `settling`, left to expire)
        return str(self.jobs.settings.key("tenant", tenant, "settle_leases"))

    def reservations(self, tenant: str) -> dict[str, float]:
        """Job id -> $ reserved, for the tenant's jobs admitted and not yet billed or ended."""
        raw = self.redis.hgetall(self.jobs.reservation_keys(tenant)[0])
        return {(k.decode() if isinstance(k, bytes) else str(k)): float(v) for k, v in raw.items()}

    def release(self, tenant: str, job_ids: list[str]) -> int:
        """End these jobs' reservations (without spend); returns how many were still held."""
        if not job_ids:
            return 0
        return int(self._release(keys=list(self.jobs.reservation_keys(tenant)), args=job_ids))

    def sync(self, tenant: str, ledger: Ledger, month: float | None = None) -> bool:
        """Raise the tenant's spend of the month holding `month` (epoch s; None: now) to the ledger's sum for that
        month; returns whether it did so, False while a live settle lease holds it off (the next sweep does it)."""
        at = time.time() if month is None else month  # one time: the month summed is the month whose key is raised
        start, end = month_window(at)
        total = ledger.spend(tenant, start, end)
        keys = [self.jobs.spend_key(tenant, at), self._leases_key(tenant)]
        return bool(int(self._raise_spend(keys=keys, args=[repr(total), SPEND_TTL_S])))


def months(start: float, end: float) -> list[float]:
    """The start (epoch s) of each UTC calendar month that [start, end] (epoch s) reaches into, in order."""
    found: list[float] = []
    while start <= end:
        first, after = month_window(start)
        found.append(first.timestamp())
        start = after.timestamp()
    return found


def _epoch(t: dt.datetime) -> float:
    """A ledger time (UTC, naive or aware) as epoch seconds."""
    return (t if t.tzinfo is not None else t.replace(tzinfo=dt.UTC)).timestamp()
