"""Who is working on a job's attempt, until when: leases and heartbeats in Redis.

A worker that starts an attempt's stage (placing it, its prefill, its transfer) holds a lease on
the attempt: `p:leases`, a sorted set of job ids by deadline, and `p:leases:info`, a hash of job
id -> {attempt, stage, owner, where, deadline}: one lease per job, the current attempt's. A QUEUED
job waiting for its dispatch holds a `queued` lease, owned by the process that queued it, granted
in the same script as the move (or the creation) it guards, so a late caller's refused move never
replaces the lease of the attempt that moved on. The deadline comes from the scheduler's
prediction for the stage (jobs/dispatch.py); the owner is the worker process, which beats in
`p:beats:worker` every `beat_s`. The sweeper (jobs/sweeper.py) takes back a lease past its
deadline or whose owner stopped beating, and retries or fails the attempt with the reason. API
processes beat in `p:beats:api` and the jobs they follow are in `p:following` (job -> API id),
so the jobs of a dead API process are found too.

Every take-back is a claim (`ZREM` of one member, or a script checking the attempt): of two
sweepers, exactly one acts on a lease.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

import redis

from prfaas.control_plane.jobs.periodic import Periodic
from prfaas.control_plane.settings import Settings

log = logging.getLogger(__name__)

# KEYS: job hash, leases zset, leases info hash. ARGV: attempt, job id, deadline, lease info JSON.
# Claims the attempt's dispatch and, in the same step, the lease on placing it: only a QUEUED job
# at that attempt not yet claimed. Returns 'ok', or why not: 'gone', 'moved' (another state or
# attempt), 'claimed' (another run of the task has it: its lease, or the sweeper, decides).
_CLAIM_DISPATCH = """
local cur = redis.call('HMGET', KEYS[1], 'state', 'attempt', 'dispatched')
if not cur[1] then return 'gone' end
if cur[1] ~= 'QUEUED' or cur[2] ~= ARGV[1] then return 'moved' end
if cur[3] == ARGV[1] then return 'claimed' end
redis.call('HSET', KEYS[1], 'dispatched', ARGV[1])
redis.call('ZADD', KEYS[2], ARGV[3], ARGV[2])
redis.call('HSET', KEYS[3], ARGV[2], ARGV[4])
return 'ok'
"""

# KEYS: leases zset, leases info hash. ARGV: job id, attempt, deadline, info JSON. Grants (or renews) a stage's
# lease (prefill, reship) unless a lease of a later attempt is held. Returns 1 when granted. A `queued` lease is
# never granted here but with the move or the check it guards, in the same script (TRANSITION, CREATE: jobs/scripts.py;
# _UNCLAIM, _REQUEUE): granted apart, a stale caller's grant replaced the lease of the attempt that had moved on.
_GRANT = """
local held = redis.call('HGET', KEYS[2], ARGV[1])
if held and cjson.decode(held)['attempt'] > tonumber(ARGV[2]) then return 0 end
redis.call('ZADD', KEYS[1], ARGV[3], ARGV[1])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[4])
return 1
"""

# KEYS: leases zset, leases info hash. ARGV: job id, attempt (0: any). Removes the lease if it is
# that attempt's. Returns the lease's info JSON when removed (the caller now owns its fate), else false.
_TAKE = """
local held = redis.call('HGET', KEYS[2], ARGV[1])
if not held then return false end
if tonumber(ARGV[2]) ~= 0 and cjson.decode(held)['attempt'] ~= tonumber(ARGV[2]) then return false end
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
return held
"""

# KEYS: leases zset, leases info hash. ARGV: job id, the info JSON read. Removes the lease only if it is still
# that very one (a sweeper acting on what it read: not a claim or grant of the same attempt made since).
_TAKE_EXACT = """
if redis.call('HGET', KEYS[2], ARGV[1]) ~= ARGV[2] then return 0 end
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
return 1
"""

# KEYS: leases zset, leases info hash. ARGV: job id, deadline, info JSON. Puts back a lease a sweeper took and
# could not act on (its pass failed: Redis away a moment): only while the job holds no lease (a move since granted
# the next attempt's, which guards it). Returns 1 when put back.
_RESTORE = """
if redis.call('HEXISTS', KEYS[2], ARGV[1]) == 1 then return 0 end
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[1])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[3])
return 1
"""


@dataclass(frozen=True)
class Lease:
    job_id: str
    attempt: int
    stage: str  # queued (waiting for its dispatch), placing, prefill, reship
    owner: str  # the worker process holding it
    where: str  # the instance the stage runs on (region/instance), "" while placing
    deadline: float  # epoch seconds on Redis's clock (`RedisClock`)

    def info(self) -> str:
        return json.dumps({"attempt": self.attempt, "stage": self.stage, "owner": self.owner, "where": self.where,
                           "deadline": self.deadline})  # fmt: skip

    @classmethod
    def of(cls, job_id: str, info: str | bytes) -> Lease:
        d = json.loads(info)
        return cls(job_id, int(d["attempt"]), d["stage"], d["owner"], d.get("where", ""), float(d["deadline"]))


def process_id(kind: str) -> str:
    """A name for this process that no other process ever had: kind, host, pid, a random tail."""
    return f"{kind}:{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


# KEYS: job hash, leases zset, leases info hash. ARGV: attempt, job id, deadline, `queued` lease info JSON.
# _UNCLAIM: undoes a dispatch's claim on the attempt (its placing lease becomes the `queued` one guarding the
# dispatch queued again), only while the job is QUEUED at it and claimed. _REQUEUE: the `queued` lease of a
# dispatch queued again by the sweeper, only while the job is QUEUED at it and unclaimed (a claim since has
# its own lease, and its dispatch runs). Each returns 1 when done.
_UNCLAIM = """
local cur = redis.call('HMGET', KEYS[1], 'state', 'attempt', 'dispatched')
if cur[1] ~= 'QUEUED' or cur[2] ~= ARGV[1] or cur[3] ~= ARGV[1] then return 0 end
redis.call('HDEL', KEYS[1], 'dispatched')
redis.call('ZADD', KEYS[2], ARGV[3], ARGV[2])
redis.call('HSET', KEYS[3], ARGV[2], ARGV[4])
return 1
"""

_REQUEUE = """
local cur = redis.call('HMGET', KEYS[1], 'state', 'attempt', 'dispatched')
if cur[1] ~= 'QUEUED' or cur[2] ~= ARGV[1] or cur[3] == ARGV[1] then return 0 end
redis.call('ZADD', KEYS[2], ARGV[3], ARGV[2])
redis.call('HSET', KEYS[3], ARGV[2], ARGV[4])
return 1
"""

# KEYS: followed-jobs hash. ARGV: job id, follower. Drops the follow if it is still that follower's.
_UNFOLLOW = """
if redis.call('HGET', KEYS[1], ARGV[1]) == ARGV[2] then return redis.call('HDEL', KEYS[1], ARGV[1]) end
return 0
"""


def lease_keys(settings: Settings) -> tuple[str, str]:
    """The leases' keys: the sorted set (job id -> deadline) and the info hash (job id -> JSON)."""
    return settings.key("leases"), settings.key("leases", "info")


class RedisClock:
    """Epoch seconds on Redis's clock (TIME), the one every lease deadline is set and aged on: a worker whose clock
    runs ahead of the one that granted a lease took it back as overrun while it ran (a sweeper 60 s ahead failed
    every stage under a minute), one behind left dead work leased. This host's clock plus the offset to Redis's,
    measured (one TIME) at most every `refresh_s`."""

    def __init__(self, client: redis.Redis, refresh_s: float = 30.0) -> None:
        self.redis: Any = client
        self.refresh_s = refresh_s
        self._offset = 0.0
        self._measured_at = float("-inf")  # monotonic
        self._lock = threading.Lock()

    def now(self) -> float:
        if time.monotonic() - self._measured_at > self.refresh_s:
            with self._lock:
                if time.monotonic() - self._measured_at > self.refresh_s:
                    before = time.time()
                    seconds, micros = self.redis.time()
                    self._offset = seconds + micros / 1e6 - (before + time.time()) / 2
                    self._measured_at = time.monotonic()
        return time.time() + self._offset


class Leases:
    def __init__(self, client: redis.Redis, settings: Settings) -> None:
        self.redis: Any = client  # redis-py types replies as Awaitable | Any
        self.settings = settings
        self.clock = RedisClock(client)  # deadlines: epoch s on Redis's clock
        self._zset, self._info = lease_keys(settings)
        self._claim = client.register_script(_CLAIM_DISPATCH)
        self._grant = client.register_script(_GRANT)
        self._take = client.register_script(_TAKE)
        self._unfollow = client.register_script(_UNFOLLOW)
        self._unclaim = client.register_script(_UNCLAIM)
        self._requeue = client.register_script(_REQUEUE)
        self._restore = client.register_script(_RESTORE)
        self._take_exact = client.register_script(_TAKE_EXACT)

    def claim_dispatch(self, lease: Lease) -> str:
        """'ok' when this caller is the one to dispatch `lease.attempt`, now under `lease`
        (see _CLAIM_DISPATCH)."""
        keys = [self.settings.key("job", lease.job_id), self._zset, self._info]
        return _text(self._claim(keys=keys, args=[lease.attempt, lease.job_id, lease.deadline, lease.info()]))

    def grant(self, lease: Lease) -> bool:
        """Grant (or renew) a stage's lease (_GRANT); False when a later attempt's is held."""
        assert lease.stage != "queued", "a queued lease comes with the move or check it guards"
        granted = self._grant(keys=[self._zset, self._info], args=[lease.job_id, lease.attempt, lease.deadline,
                                                                  lease.info()])  # fmt: skip
        return bool(granted)

    def take(self, job_id: str, attempt: int = 0) -> Lease | None:
        """Remove the lease of `attempt` (0: whatever attempt); the lease if this call removed it."""
        held = self._take(keys=[self._zset, self._info], args=[job_id, attempt])
        return Lease.of(job_id, held) if held else None

    def take_exact(self, lease: Lease) -> bool:
        """Remove `lease` if it is still the one held (as read by `all`); True when this call removed it."""
        return bool(self._take_exact(keys=[self._zset, self._info], args=[lease.job_id, lease.info()]))

    def restore(self, lease: Lease) -> bool:
        """Put back `lease`, taken by a sweeper that could not act on it (_RESTORE): not while the job holds
        another; True when put back."""
        return bool(self._restore(keys=[self._zset, self._info], args=[lease.job_id, lease.deadline, lease.info()]))

    def get(self, job_id: str) -> Lease | None:
        held = self.redis.hget(self._info, job_id)
        return Lease.of(job_id, held) if held else None

    def all(self) -> list[Lease]:
        return [Lease.of(_text(job), info) for job, info in self.redis.hgetall(self._info).items()]

    def count(self) -> int:
        return int(self.redis.zcard(self._zset))

    # -- which API process streams each job's tokens (a dead one's jobs: jobs/sweeper.py) ----

    def follow(self, job_id: str, owner: str) -> None:
        self.redis.hset(self.settings.key("following"), job_id, owner)

    def unfollow(self, job_id: str, owner: str) -> bool:
        """Drop `job_id` from the followed jobs if `owner` follows it; True when this call did."""
        return bool(self._unfollow(keys=[self.settings.key("following")], args=[job_id, owner]))

    def follower_of(self, job_id: str) -> str | None:
        """The process following `job_id` now; None when none does."""
        owner = self.redis.hget(self.settings.key("following"), job_id)
        return None if owner is None else _text(owner)

    def refollow(self, job_id: str, owner: str) -> bool:
        """Give the follow of `job_id` back to `owner` (a sweeper that took it could not act on it), unless
        someone follows it now; True when given back."""
        return bool(self.redis.hsetnx(self.settings.key("following"), job_id, owner))

    def unclaim(self, queued: Lease) -> bool:
        """Undo a dispatch's claim on `queued.attempt` while the job is still QUEUED at it, under `queued` (its
        dispatch queued again) in the same step (_UNCLAIM)."""
        return self._guarded(self._unclaim, queued)

    def requeue(self, queued: Lease) -> bool:
        """Grant `queued` for a dispatch queued again while the job is still QUEUED at its attempt and unclaimed
        (_REQUEUE); False when it moved on or a dispatch claimed it."""
        return self._guarded(self._requeue, queued)

    def _guarded(self, script: Any, queued: Lease) -> bool:
        assert queued.stage == "queued"
        keys = [self.settings.key("job", queued.job_id), self._zset, self._info]
        return bool(script(keys=keys, args=[queued.attempt, queued.job_id, queued.deadline, queued.info()]))

    def following(self) -> dict[str, str]:
        """Job id -> the API process following it."""
        return {_text(k): _text(v) for k, v in self.redis.hgetall(self.settings.key("following")).items()}


# Beats are stamped and aged on Redis's clock (TIME), not the hosts': a host whose clock lags the sweeper's by
# more than `dead_after_s` was declared dead while it beat, and every job it followed FAILED.
# KEYS: beats zset. ARGV: process id, seconds its beat is set back (0: a beat; past `dead_after_s`: it stopped).
_BEAT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
redis.call('ZADD', KEYS[1], now - tonumber(ARGV[2]), ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - 3600)
return 1
"""

# KEYS: beats zset. ARGV: dead_after_s. The processes that beat within it.
_ALIVE = """
local t = redis.call('TIME')
return redis.call('ZRANGEBYSCORE', KEYS[1], tonumber(t[1]) + tonumber(t[2]) / 1000000 - tonumber(ARGV[1]), '+inf')
"""


class Heartbeats:
    """Processes of one kind (`worker`, `api`) beating in a sorted set (id -> last beat, epoch s on Redis's
    clock). `start` beats every `beat_s` from a daemon thread; a process is alive while its last beat
    is under `dead_after_s` old. Ids of processes dead for an hour are dropped."""

    def __init__(self, client: redis.Redis, settings: Settings, kind: str) -> None:
        self.redis: Any = client
        self.settings = settings
        self.key = settings.key("beats", kind)
        self.me = process_id(kind)
        self._beat = client.register_script(_BEAT)
        self._alive = client.register_script(_ALIVE)
        self._ticker = Periodic(f"beat-{self.key}", settings.beat_s, self.beat, _retry_next_beat)

    def beat(self) -> None:
        self._beat(keys=[self.key], args=[self.me, 0])

    def start(self) -> Heartbeats:
        self.beat()
        self._ticker.start()
        return self

    def stop(self) -> None:
        """Stop beating and say so (the others need not wait for the beats to age)."""
        self._ticker.stop(join_s=5)
        self._beat(keys=[self.key], args=[self.me, self.settings.dead_after_s + 1])  # known, and dead now

    def alive(self) -> set[str]:
        return {_text(m) for m in self._alive(keys=[self.key], args=[self.settings.dead_after_s])}

    def known(self) -> set[str]:
        """Every process that beat in the last hour, alive or not."""
        return {_text(m) for m in self.redis.zrange(self.key, 0, -1)}


def _retry_next_beat(exc: Exception) -> None:
    if not isinstance(exc, redis.RedisError):  # Redis away for a moment: the next beat tries again
        log.exception("heartbeat failed; the next one tries again", exc_info=exc)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
