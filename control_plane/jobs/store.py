"""The Redis job store: one hash per job, its timeline (a list), per-tenant indexes.

Every state change is one Lua script (atomic in Redis; jobs/scripts.py): it checks the move is legal
from the current state (the table of jobs/states.py) and carries the job's current attempt (a
stale attempt's move is refused), appends to the timeline, keeps the tenant's active set, ends a
FAILED / CANCELED job's budget reservation and sets the TTL of finished jobs.

Admission is two scripts around tokenizing (api/completions.py): `admit` (idempotency key, budget
headroom, concurrency cap, rate limit; the request then holds a concurrency slot) runs before the
prompt is tokenized, so a tenant over a limit costs no tokenizer time; `create` reserves the job's
predicted $ within the budget and writes the job. A request refused in between (`release`) gives its
slot and its rate count back; a slot never given back (the process died) lapses after `admission.hold_s`.

Keys (prefix `p`): `p:job:{id}` hash, `p:job:{id}:timeline` list of JSON entries (both expire
`job.timeout_s + job.ttl_s` after creation, `job.ttl_s` after a terminal move), `p:job:{id}:ready`
list (dispatch -> API: where to decode), `p:tenant:{t}:jobs` zset (created at; entries past the keys'
TTL trimmed at each creation), `p:tenant:{t}:active` set, `p:tenant:{t}:admitting` zset (admitted,
not yet created: job id -> hold deadline), `p:tenant:{t}:spend:{YYYYMM}` float,
`p:tenant:{t}:reserved` hash (job id -> $ reserved) and `p:tenant:{t}:reserved_usd` (their sum),
`p:tenant:{t}:rate:{epoch s}` counter, `p:idem:{t}:{key}` ('job id body-sha256').
Pub/sub channel `p:job:{id}:notify`: a hand-off was posted or the job ended (wakes `wait_ready`).
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

import redis

from prfaas.control_plane.jobs.errors import AdmissionRefused, IllegalTransition, JobNotFound, StaleAttempt
from prfaas.control_plane.jobs.leases import Lease, RedisClock, lease_keys
from prfaas.control_plane.jobs.notifier import Notifier
from prfaas.control_plane.jobs.scripts import ADMIT, CREATE, FORGET, RELEASE, TRANSITION, UPDATE
from prfaas.control_plane.jobs.states import TERMINAL, JobState
from prfaas.control_plane.settings import Settings
from prfaas.control_plane.tenants import Quota

# The cancel reason of a job whose client went away: the job is marked `client_left`, and a request sent again
# with its Idempotency-Key gets a fresh job (`JobStore.admit`), as a retry after a dropped connection expects.
CLIENT_LEFT = "client disconnected"
# The cancel reason of a job whose API process shut down before it ended (api/shutdown.py): marked `client_left`
# too, since its client was let go and its retry, at another API process, is the one the key is for.
SHUTTING_DOWN = "server shutting down"


@dataclass(frozen=True)
class Admission:
    """A request let in before its prompt is tokenized (`JobStore.admit`). Unless `existing`, it holds a
    concurrency slot and a rate count until `JobStore.create` writes its job or `JobStore.release` gives
    them back (or `admission.hold_s` passes)."""

    tenant: str
    job_id: str  # the job to create; `existing`: the job an earlier request with the same key created
    existing: bool
    rate_key: str
    idempotency_key: str | None = None
    body_hash: str = ""


@dataclass(frozen=True)
class Created:
    """What `JobStore.create` wrote, or found: an Idempotency-Key seen before names the first POST's job."""

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


def _glob_escape(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


class JobStore:
    def __init__(self, client: redis.Redis, settings: Settings) -> None:
        # redis-py types every reply as `Awaitable | Any` (one stub for sync and async clients)
        self.redis: Any = client
        self.settings = settings
        self.clock = RedisClock(client)  # lease deadlines are on Redis's clock
        self.notifier = Notifier(client, _glob_escape(settings.key("job")) + ":*:notify")
        self._transition = client.register_script(TRANSITION)
        self._admit = client.register_script(ADMIT)
        self._release = client.register_script(RELEASE)
        self._create = client.register_script(CREATE)
        self._update = client.register_script(UPDATE)
        self._forget = client.register_script(FORGET)

    def _job(self, job_id: str) -> str:
        return self.settings.key("job", job_id)

    def spend_key(self, tenant: str, now: float | None = None) -> str:
        return self.settings.key("tenant", tenant, "spend", time.strftime("%Y%m", time.gmtime(now or time.time())))

    def reservation_keys(self, tenant: str) -> tuple[str, str]:
        """The tenant's budget reservations: (hash job id -> $, their sum)."""
        return self.settings.key("tenant", tenant, "reserved"), self.settings.key("tenant", tenant, "reserved_usd")

    def _idem(self, tenant: str, idempotency_key: str | None) -> str:
        return self.settings.key("idem", tenant, idempotency_key) if idempotency_key else ""

    def key_used(self, tenant: str, idempotency_key: str) -> bool:
        """An Idempotency-Key of `tenant`'s that names a job already (a request sent again)."""
        return bool(self.redis.exists(self._idem(tenant, idempotency_key)))

    def admit(
        self,
        tenant: str,
        quota: Quota,
        job_id: str | None = None,
        idempotency_key: str | None = None,
        body_hash: str = "",
    ) -> Admission:
        """Let a request in before its prompt is tokenized: an Idempotency-Key seen before names its job
        (`existing`; with another `body_hash`: refused, `idempotency`), unless that job was canceled because its
        client left or its API process shut down (CLIENT_LEFT, SHUTTING_DOWN: the retry the key is for, which
        gets a fresh job); else the budget must have
        headroom (spend + reserved < budget), the tenant be under its concurrency cap (active jobs and admissions
        in progress) and its rate. Raises AdmissionRefused (`idempotency`, `budget`, `concurrency`, `rate`)."""
        admission = self._admitted(tenant, quota, job_id, idempotency_key, body_hash)
        if admission.existing and self._left(admission.job_id):  # once: a key names a left job only once
            self._forget(keys=[self._idem(tenant, idempotency_key)], args=[admission.job_id])
            admission = self._admitted(tenant, quota, job_id, idempotency_key, body_hash)
        return admission

    def _left(self, job_id: str) -> bool:
        """The job was canceled because its client went away or was let go (`Follower.cancel` with CLIENT_LEFT or
        SHUTTING_DOWN)."""
        state, left = self.redis.hmget(self._job(job_id), ["state", "client_left"])
        return _text(state) == JobState.CANCELED.value and _text(left) == "1"

    def _admitted(
        self, tenant: str, quota: Quota, job_id: str | None, idempotency_key: str | None, body_hash: str
    ) -> Admission:
        job_id = job_id or str(uuid.uuid4())
        now = time.time()
        k = self.settings.key
        rate_key = k("tenant", tenant, "rate", str(int(now)))
        hold_s = self.settings.admission.hold_s
        keys = [
            self._idem(tenant, idempotency_key), self.spend_key(tenant, now), self.reservation_keys(tenant)[1],
            k("tenant", tenant, "active"), k("tenant", tenant, "admitting"), rate_key,
        ]  # fmt: skip
        args: list[Any] = [job_id, now, max(1, int(quota.rps)), quota.concurrency, quota.budget_usd, now + hold_s]
        code, value = self._admit(keys=keys, args=[*args, body_hash, int(hold_s) + 1])
        code, value = _text(code), _text(value)
        if code == "admitted":
            return Admission(tenant, job_id, False, rate_key, idempotency_key, body_hash)
        if code == "existing":
            return Admission(tenant, value, True, rate_key, idempotency_key, body_hash)
        raise AdmissionRefused(code)

    def release(self, admission: Admission) -> None:
        """Give an admission's concurrency slot and rate count back (its request was refused after `admit`).
        Idempotent; a no-op once `create` wrote the job."""
        if admission.existing:
            return
        admitting = self.settings.key("tenant", admission.tenant, "admitting")
        self._release(keys=[admitting, admission.rate_key], args=[admission.job_id])

    def create(
        self,
        tenant: str,
        fields: dict[str, Any],
        quota: Quota,
        idempotency_key: str | None = None,
        handed_off: HandedOff | None = None,
        job_id: str | None = None,
        *,
        admission: Admission | None = None,
        reserve_usd: float = 0.0,
        follow_as: str = "",
    ) -> Created:
        """Write a QUEUED job (attempt 1), or one already `handed_off`, reserving `reserve_usd` of the tenant's
        budget until it is billed or ends unbilled. `admission`: what `admit` let in (None: admitted here,
        `admit` with `idempotency_key` and `job_id`). Refused (AdmissionRefused, the admission given back):
        `budget` when spend + reserved + `reserve_usd` would pass the budget; `idempotency` when a concurrent
        request with the same key and another body won; a concurrent one with the same body is `existing`.
        `follow_as`: the API process that streams the job follows it from its creation (jobs/leases.py); a job
        not handed off is written with the `queued` lease, owned by it, that guards its first dispatch: should it
        die before it queues the dispatch, the sweeper queues it (at once, or `dispatch.visibility_s` on)."""
        if admission is None:
            admission = self.admit(tenant, quota, job_id, idempotency_key)
        if admission.existing:
            return Created(admission.job_id, existing=True, record={})
        job_id, s = admission.job_id, self.settings
        now = time.time()
        state = handed_off.state if handed_off else JobState.QUEUED
        record: dict[str, Any] = {"id": job_id, "tenant": tenant, "state": state.value, "attempt": 1}
        record |= {"created_at": now, "updated_at": now} | fields
        if reserve_usd > 0:
            record["reserved_usd"] = reserve_usd
        encoded = {name: _text(_encode(value)) for name, value in record.items()}
        flat = [x for pair in encoded.items() for x in pair]
        k = s.key
        keys = [
            self._job(job_id), self._job(job_id) + ":timeline", k("tenant", tenant, "jobs"),
            k("tenant", tenant, "active"), k("tenant", tenant, "admitting"), admission.rate_key,
            self.spend_key(tenant, now), *self.reservation_keys(tenant), self._idem(tenant, admission.idempotency_key),
            self._job(job_id) + ":ready" if handed_off else "", s.key("following") if follow_as else "",
        ]  # fmt: skip
        queued = ["", ""]  # the `queued` lease, with the job, or none
        if follow_as and not handed_off:
            lease = Lease(job_id, 1, "queued", follow_as, "", self.clock.now() + s.dispatch.visibility_s)
            keys.extend(lease_keys(s))
            queued = [repr(lease.deadline), lease.info()]
        else:
            keys.extend(["", ""])
        keep_s = int(s.job.timeout_s) + s.job.ttl_s  # a live job's keys: its deadline, then as long as a finished one
        args: list[Any] = [job_id, now, quota.budget_usd, repr(float(reserve_usd)), keep_s, now - keep_s, s.job.ttl_s]
        args.append(admission.body_hash)
        start: list[Any] = ["", "", ""]
        if handed_off:
            start = [state.value, handed_off.note, json.dumps({"attempt": 1} | handed_off.ready)]
        code, value = self._create(keys=keys, args=[*args, len(record), *flat, *start, follow_as, *queued])
        code, value = _text(code), _text(value)
        if code == "existing":
            return Created(value, existing=True, record={})
        if code != "created":
            raise AdmissionRefused(code)
        return Created(value, existing=False, record=encoded)

    def transition(
        self,
        job_id: str,
        target: JobState,
        attempt: int,
        note: str = "",
        cost_usd: float = 0.0,
        tenant: str | None = None,
        log_token: str | None = None,
        unfollow: str = "",
        grant: Lease | None = None,
        **fields: Any,
    ) -> int:
        """Move the job to `target` for `attempt` (0 with CANCELED: any attempt; attempt + 1 with
        QUEUED: a new attempt). `tenant`, when the caller knows the job's, saves a read. In the same step, and
        only if the move is made: `log_token`, a token log entry appended (jobs/tokenlog.py); `unfollow`, the
        follower that stops following the job if the move ends it; `grant`, a lease granted in place of whatever
        lease the job holds (a move to QUEUED: the `queued` lease that guards the new attempt; jobs/leases.py).
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
            *self.reservation_keys(_text(tenant)),
            self.settings.key("tenant", _text(tenant), "jobs"),
            self._job(job_id) + ":tokens" if log_token is not None else "",
            self._job(job_id) + ":attached",
            self.settings.key("following") if unfollow else "",
            *(lease_keys(self.settings) if grant else ("", "")),
        ]
        args: list[Any] = [target.value, attempt, time.time(), self.settings.job.ttl_s, note, cost_usd, len(fields),
                           *flat, log_token or "", unfollow]  # fmt: skip
        if grant is not None:
            assert grant.job_id == job_id
            args += [job_id, repr(grant.deadline), grant.info()]
        code, state, current = self._transition(keys=keys, args=args)
        code = _text(code)
        if code == "not_found":
            raise JobNotFound(job_id)
        if code == "illegal":
            raise IllegalTransition(job_id, _text(state), target.value)
        if code == "stale":
            raise StaleAttempt(job_id, int(current), attempt)
        return int(current)

    def update(self, job_id: str, attempt: int, *, unless: str = "", **fields: Any) -> bool:
        """Set fields while `attempt` is current (and the job has no field `unless`), in one script (checked and
        written in one step, however busy the job); False when it is stale, refused or the job is gone."""
        flat = [x for name, value in fields.items() for x in (name, _encode(value))]
        return bool(self._update(keys=[self._job(job_id)], args=[attempt, unless, *flat]))

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

    def fields_of(self, job_ids: list[str], names: list[str]) -> list[dict[str, str] | None]:
        """The fields `names` of each job (those it has), all in one round trip; None for a job that is gone
        (ask for `state`: every job has one)."""
        with self.redis.pipeline(transaction=False) as pipe:
            for job_id in job_ids:
                pipe.hmget(self._job(job_id), names)
            replies = pipe.execute()
        found = [{n: _text(v) for n, v in zip(names, values, strict=True) if v is not None} for values in replies]
        return [job or None for job in found]

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

    def reserved(self, tenant: str) -> float:
        """$ of the tenant's budget reserved by jobs admitted and not yet billed (or ended unbilled)."""
        return float(self.redis.get(self.reservation_keys(tenant)[1]) or 0.0)

    # -- dispatch -> API hand-off: where the tokens of the current attempt come from -------

    def post_ready(self, job_id: str, attempt: int, info: dict[str, Any]) -> None:
        key = self._job(job_id) + ":ready"
        with self.redis.pipeline() as pipe:
            pipe.rpush(key, json.dumps({"attempt": attempt} | info))
            pipe.expire(key, self.settings.job.ttl_s)
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
        notified = self.notifier.watch(channel)  # before the first read: a notice after it is kept
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
                notified.wait(min(remaining, 1.0 if self.notifier.live else 0.02))
        finally:
            self.notifier.unwatch(channel, notified)


def _encode(value: Any) -> str | int | float:
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, str | int | float):
        return value
    return json.dumps(value)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
