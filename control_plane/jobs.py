"""The Redis job store: one hash per job, its timeline (a list), per-tenant indexes.

Every state change is one Lua script (atomic in Redis): it checks the move is legal from the
current state and carries the job's current attempt (a stale attempt's move is refused),
appends to the timeline, keeps the tenant's active set, bills a `DONE` job exactly once and
sets the TTL of finished jobs. Creation is one script too: idempotency key, rate limit,
concurrency cap and budget are checked and the job written in the same step.

Keys (prefix `p`): `p:job:{id}` hash, `p:job:{id}:timeline` list of JSON entries,
`p:job:{id}:ready` list (dispatch -> API: where to decode), `p:tenant:{t}:jobs` zset (created
at), `p:tenant:{t}:active` set, `p:tenant:{t}:spend:{YYYYMM}` float, `p:idem:{t}:{key}`.
Pub/sub channel `p:job:{id}:notify`: a hand-off was posted or the job ended (wakes `wait_ready`).
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import redis

from prfaas.control_plane.settings import Settings


class JobState(StrEnum):
    QUEUED = "QUEUED"
    PREFILLING = "PREFILLING"
    TRANSFERRING = "TRANSFERRING"
    DECODING = "DECODING"
    LOCAL = "LOCAL"
    DONE = "DONE"
    FAILED = "FAILED"
    CANCELED = "CANCELED"


TERMINAL = frozenset({JobState.DONE, JobState.FAILED, JobState.CANCELED})


class JobStoreError(Exception):
    """Base of the job store's typed errors."""


class JobNotFound(JobStoreError):
    pass


class IllegalTransition(JobStoreError):
    def __init__(self, job_id: str, current: str, target: str) -> None:
        super().__init__(f"job {job_id}: {current} -> {target} is not a legal transition")
        self.current = current


class StaleAttempt(JobStoreError):
    def __init__(self, job_id: str, current: int, given: int) -> None:
        super().__init__(f"job {job_id}: attempt {given} is stale (current attempt {current})")
        self.current = current


class AdmissionRefused(JobStoreError):
    """`reason`: `rate`, `concurrency` or `budget`."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


# Moves to QUEUED start a new attempt (attempt + 1); CANCELED with attempt 0 is the tenant's cancel.
_TRANSITION = """
local legal = {
  QUEUED = {PREFILLING=1, LOCAL=1, FAILED=1, CANCELED=1, QUEUED=1},
  PREFILLING = {TRANSFERRING=1, FAILED=1, CANCELED=1, QUEUED=1},
  TRANSFERRING = {DECODING=1, FAILED=1, CANCELED=1, QUEUED=1},
  DECODING = {DONE=1, FAILED=1, CANCELED=1, QUEUED=1},
  LOCAL = {DONE=1, FAILED=1, CANCELED=1, QUEUED=1},
}
local cur = redis.call('HMGET', KEYS[1], 'state', 'attempt')
if not cur[1] then return {'not_found', '', 0} end
local state, attempt = cur[1], tonumber(cur[2])
local target, given, now = ARGV[1], tonumber(ARGV[2]), ARGV[3]
local moves = legal[state]
if not moves then return {'illegal', state, attempt} end
if target == 'QUEUED' then
  if given ~= attempt + 1 then return {'stale', state, attempt} end
elseif not (target == 'CANCELED' and given == 0) and given ~= attempt then
  return {'stale', state, attempt}
end
if not moves[target] then return {'illegal', state, attempt} end
local new_attempt = attempt
if target == 'QUEUED' then new_attempt = given end
redis.call('HSET', KEYS[1], 'state', target, 'attempt', new_attempt, 'updated_at', now)
local n = tonumber(ARGV[7])
for i = 1, n do redis.call('HSET', KEYS[1], ARGV[7 + 2 * i - 1], ARGV[7 + 2 * i]) end
redis.call('RPUSH', KEYS[2], cjson.encode({state=target, attempt=new_attempt, at=tonumber(now), note=ARGV[5]}))
if target == 'DONE' or target == 'FAILED' or target == 'CANCELED' then
  redis.call('SREM', KEYS[3], redis.call('HGET', KEYS[1], 'id'))
  if target == 'DONE' and tonumber(ARGV[6]) > 0 then redis.call('INCRBYFLOAT', KEYS[4], ARGV[6]) end
  redis.call('EXPIRE', KEYS[1], ARGV[4])
  redis.call('EXPIRE', KEYS[2], ARGV[4])
  redis.call('PUBLISH', KEYS[1] .. ':notify', target)
end
return {'ok', target, new_attempt}
"""

# KEYS: job, timeline, tenant index, active set, spend, rate window, idempotency key ('' = none),
#       ready list ('' = none)
# ARGV: id, now, rps, concurrency, budget, ttl, n, field/value pairs, then the state the job
#       starts in past QUEUED ('' = none), its timeline note, and the hand-off to post
#       (a placement decided at admission: the job is written already handed off)
_CREATE = """
if KEYS[7] ~= '' then
  local existing = redis.call('GET', KEYS[7])
  if existing then return {'existing', existing} end
end
local spend = tonumber(redis.call('GET', KEYS[5]) or '0')
if spend >= tonumber(ARGV[5]) then return {'budget', ''} end
if redis.call('SCARD', KEYS[4]) >= tonumber(ARGV[4]) then return {'concurrency', ''} end
local count = redis.call('INCR', KEYS[6])
if count == 1 then redis.call('EXPIRE', KEYS[6], 2) end
if count > tonumber(ARGV[3]) then return {'rate', ''} end
local n = tonumber(ARGV[7])
for i = 1, n do redis.call('HSET', KEYS[1], ARGV[7 + 2 * i - 1], ARGV[7 + 2 * i]) end
redis.call('RPUSH', KEYS[2], cjson.encode({state='QUEUED', attempt=1, at=tonumber(ARGV[2]), note='created'}))
local start = 8 + 2 * n
if ARGV[start] ~= '' then
  redis.call('RPUSH', KEYS[2], cjson.encode({state=ARGV[start], attempt=1, at=tonumber(ARGV[2]), note=ARGV[start + 1]}))
end
if KEYS[8] ~= '' then
  redis.call('RPUSH', KEYS[8], ARGV[start + 2])
  redis.call('EXPIRE', KEYS[8], ARGV[6])
end
redis.call('ZADD', KEYS[3], ARGV[2], ARGV[1])
redis.call('SADD', KEYS[4], ARGV[1])
if KEYS[7] ~= '' then redis.call('SET', KEYS[7], ARGV[1], 'EX', ARGV[6]) end
return {'created', ARGV[1]}
"""


@dataclass(frozen=True)
class Quota:
    rps: float
    concurrency: int
    budget_usd: float


@dataclass(frozen=True)
class Created:
    job_id: str
    existing: bool  # an Idempotency-Key replay: the job created by the first POST
    record: dict[str, str]  # the job's hash as written (empty for a replay)


@dataclass(frozen=True)
class HandedOff:
    """A placement decided at admission: the job starts in `state` (past QUEUED, attempt 1)
    with `ready` already posted, as a dispatcher would have left it."""

    state: JobState
    note: str
    ready: dict[str, Any]


class _Notifier:
    """One pattern subscription per process (`{prefix}:job:*:notify`), started at the first
    `watch`: a thread wakes the `wait_ready` callers of a job when its channel gets a message.
    Every API process gets every notice, so any of them may follow a job. When the
    subscription breaks it wakes every waiter (a notice may have been lost), and `live` is
    False until it is back: waiters then poll."""

    def __init__(self, client: redis.Redis, pattern: str) -> None:
        self._client: Any = client  # redis-py's `pubsub` is untyped
        self._pattern = pattern
        self._lock = threading.Lock()
        self._waiters: dict[str, set[threading.Event]] = {}
        self._live = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def live(self) -> bool:
        return self._live.is_set()

    def watch(self, channel: str) -> threading.Event:
        """An event set at each notice on `channel`; once `live`, no notice published after this returns is missed."""
        event = threading.Event()
        with self._lock:
            self._waiters.setdefault(channel, set()).add(event)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="job-notify", daemon=True)
                self._thread.start()
        self._live.wait(1.0)
        return event

    def unwatch(self, channel: str, event: threading.Event) -> None:
        with self._lock:
            events = self._waiters.get(channel)
            if events is not None:
                events.discard(event)
                if not events:
                    del self._waiters[channel]

    def _wake(self, channel: str | None) -> None:
        with self._lock:
            if channel is None:
                events = [e for group in self._waiters.values() for e in group]
            else:
                events = list(self._waiters.get(channel, ()))
        for event in events:
            event.set()

    def _run(self) -> None:
        while True:
            pubsub = self._client.pubsub()
            try:
                pubsub.psubscribe(self._pattern)
                while True:
                    message = pubsub.get_message(timeout=1.0)
                    if message is None:
                        continue
                    if message["type"] == "psubscribe":
                        self._live.set()
                        self._wake(None)  # notices of the gap before (re)subscribing are lost: re-read
                    elif message["type"] == "pmessage":
                        self._wake(_text(message["channel"]))
            except (redis.RedisError, OSError, ValueError):  # ValueError: the pool closed the socket under us
                self._live.clear()
                self._wake(None)
                time.sleep(0.1)
            finally:
                pubsub.close()


def _glob_escape(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


class JobStore:
    def __init__(self, client: redis.Redis, settings: Settings) -> None:
        # redis-py types every reply as `Awaitable | Any` (one stub for sync and async clients)
        self.redis: Any = client
        self.settings = settings
        self._notifier = _Notifier(client, _glob_escape(settings.key("job")) + ":*:notify")
        self._transition = client.register_script(_TRANSITION)
        self._create = client.register_script(_CREATE)

    def _job(self, job_id: str) -> str:
        return self.settings.key("job", job_id)

    def spend_key(self, tenant: str, now: float | None = None) -> str:
        return self.settings.key("tenant", tenant, "spend", time.strftime("%Y%m", time.gmtime(now or time.time())))

    def create(
        self,
        tenant: str,
        fields: dict[str, Any],
        quota: Quota,
        idempotency_key: str | None = None,
        handed_off: HandedOff | None = None,
        job_id: str | None = None,
    ) -> Created:
        """Admit and write a QUEUED job (attempt 1), or one already `handed_off`. Raises AdmissionRefused."""
        job_id = job_id or str(uuid.uuid4())
        now = time.time()
        state = handed_off.state if handed_off else JobState.QUEUED
        record: dict[str, Any] = {"id": job_id, "tenant": tenant, "state": state.value, "attempt": 1}
        record |= {"created_at": now, "updated_at": now} | fields
        encoded = {name: _text(_encode(value)) for name, value in record.items()}
        flat = [x for pair in encoded.items() for x in pair]
        k = self.settings.key
        keys = [
            self._job(job_id),
            self._job(job_id) + ":timeline",
            k("tenant", tenant, "jobs"),
            k("tenant", tenant, "active"),
            self.spend_key(tenant, now),
            k("tenant", tenant, "rate", str(int(now))),
            k("idem", tenant, idempotency_key) if idempotency_key else "",
            self._job(job_id) + ":ready" if handed_off else "",
        ]
        args: list[Any] = [job_id, now, max(1, int(quota.rps)), quota.concurrency, quota.budget_usd]
        args.append(self.settings.job_ttl_s)
        start: list[Any] = ["", "", ""]
        if handed_off:
            start = [state.value, handed_off.note, json.dumps({"attempt": 1} | handed_off.ready)]
        code, value = self._create(keys=keys, args=[*args, len(record), *flat, *start])
        code, value = _text(code), _text(value)
        if code in ("rate", "concurrency", "budget"):
            raise AdmissionRefused(code)
        existing = code == "existing"
        return Created(value, existing=existing, record={} if existing else encoded)

    def transition(
        self,
        job_id: str,
        target: JobState,
        attempt: int,
        note: str = "",
        cost_usd: float = 0.0,
        tenant: str | None = None,
        **fields: Any,
    ) -> int:
        """Move the job to `target` for `attempt` (0 with CANCELED: any attempt; attempt + 1 with
        QUEUED: a new attempt). `tenant`, when the caller knows the job's, saves a read.
        Returns the job's attempt after the move. Raises JobNotFound, IllegalTransition, StaleAttempt."""
        if tenant is None:
            tenant = self.redis.hget(self._job(job_id), "tenant")
            if tenant is None:
                raise JobNotFound(job_id)
        flat = [x for name, value in fields.items() for x in (name, _encode(value))]
        keys = [
            self._job(job_id),
            self._job(job_id) + ":timeline",
            self.settings.key("tenant", _text(tenant), "active"),
            self.spend_key(_text(tenant)),
        ]
        args: list[Any] = [
            target.value,
            attempt,
            time.time(),
            self.settings.job_ttl_s,
            note,
            cost_usd,
            len(fields),
            *flat,
        ]
        code, state, current = self._transition(keys=keys, args=args)
        code = _text(code)
        if code == "not_found":
            raise JobNotFound(job_id)
        if code == "illegal":
            raise IllegalTransition(job_id, _text(state), target.value)
        if code == "stale":
            raise StaleAttempt(job_id, int(current), attempt)
        return int(current)

    def update(self, job_id: str, attempt: int, **fields: Any) -> bool:
        """Set fields while `attempt` is current (WATCH/MULTI, retried when a concurrent write to the job
        interferes); False when it is stale or the job is gone."""
        key = self._job(job_id)
        for _ in range(10):  # another write to the job (a transition) between WATCH and EXEC: read again
            with self.redis.pipeline() as pipe:
                try:
                    pipe.watch(key)
                    current = pipe.hget(key, "attempt")
                    if current is None or int(current) != attempt:
                        return False
                    pipe.multi()
                    pipe.hset(key, mapping={name: _encode(value) for name, value in fields.items()})
                    pipe.execute()
                    return True
                except redis.WatchError:
                    continue
        return False

    def get(self, job_id: str) -> dict[str, str]:
        raw = self.redis.hgetall(self._job(job_id))
        if not raw:
            raise JobNotFound(job_id)
        return {_text(k): _text(v) for k, v in raw.items()}

    def get_for(self, tenant: str, job_id: str) -> dict[str, str]:
        """The job if it belongs to `tenant`; JobNotFound otherwise (no existence leaks)."""
        job = self.get(job_id)
        if job.get("tenant") != tenant:
            raise JobNotFound(job_id)
        return job

    def timeline(self, job_id: str) -> list[dict[str, Any]]:
        return [json.loads(item) for item in self.redis.lrange(self._job(job_id) + ":timeline", 0, -1)]

    def with_timelines(self, job_ids: list[str]) -> list[tuple[dict[str, str], list[dict[str, Any]]] | None]:
        """Each job and its timeline, all in one round trip; None for a job that is gone."""
        with self.redis.pipeline(transaction=False) as pipe:
            for job_id in job_ids:
                pipe.hgetall(self._job(job_id))
                pipe.lrange(self._job(job_id) + ":timeline", 0, -1)
            replies = pipe.execute()
        out: list[tuple[dict[str, str], list[dict[str, Any]]] | None] = []
        for raw, timeline in zip(replies[::2], replies[1::2], strict=True):
            job = {_text(k): _text(v) for k, v in raw.items()}
            out.append((job, [json.loads(item) for item in timeline]) if job else None)
        return out

    def list_for(self, tenant: str, limit: int = 100) -> list[dict[str, str]]:
        ids = self.redis.zrevrange(self.settings.key("tenant", tenant, "jobs"), 0, max(0, limit - 1))
        jobs = []
        for raw_id in ids:
            try:
                jobs.append(self.get(_text(raw_id)))
            except JobNotFound:  # expired: drop it from the index lazily
                self.redis.zrem(self.settings.key("tenant", tenant, "jobs"), raw_id)
        return jobs

    def active_count(self, tenant: str) -> int:
        return int(self.redis.scard(self.settings.key("tenant", tenant, "active")))

    def spend(self, tenant: str) -> float:
        return float(self.redis.get(self.spend_key(tenant)) or 0.0)

    # -- dispatch -> API hand-off: where the tokens of the current attempt come from -------

    def post_ready(self, job_id: str, attempt: int, info: dict[str, Any]) -> None:
        key = self._job(job_id) + ":ready"
        with self.redis.pipeline() as pipe:
            pipe.rpush(key, json.dumps({"attempt": attempt} | info))
            pipe.expire(key, self.settings.job_ttl_s)
            pipe.publish(self._job(job_id) + ":notify", attempt)
            pipe.execute()

    def wait_ready(self, job_id: str, after_attempt: int, timeout_s: float) -> dict[str, Any] | None:
        """The next hand-off for an attempt > `after_attempt`, or None at the deadline or when
        the job ended. Reads the list without consuming it (another API process may stream).
        Blocks on the job's notify channel (`post_ready` and terminal moves publish to it)
        between reads; re-reads at least every second, every 20 ms while the subscription is down."""
        deadline = time.monotonic() + timeout_s
        key = self._job(job_id) + ":ready"
        channel = self._job(job_id) + ":notify"
        notified = self._notifier.watch(channel)  # before the first read: a notice after it is kept
        try:
            seen = 0
            while True:
                notified.clear()  # before reading: a notice that comes during the reads stays set
                for item in self.redis.lrange(key, seen, -1):
                    seen += 1
                    info: dict[str, Any] = json.loads(item)
                    if info["attempt"] > after_attempt:
                        return info
                state = self.redis.hget(self._job(job_id), "state")
                remaining = deadline - time.monotonic()
                if state is None or _text(state) in TERMINAL or remaining <= 0:
                    return None
                notified.wait(min(remaining, 1.0 if self._notifier.live else 0.02))
        finally:
            self._notifier.unwatch(channel, notified)


def _encode(value: Any) -> str | int | float:
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, str | int | float):
        return value
    return json.dumps(value)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
