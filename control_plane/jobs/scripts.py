"""The job store's Lua scripts: each state change and each admission is one script, atomic in Redis.

`TRANSITION` is generated from the state machine's table (jobs/states.py: `LEGAL_MOVES`, `TERMINAL`), so
the legal moves are written once, in Python. Admission is two steps around tokenizing: `ADMIT` (idempotency,
budget headroom, concurrency, rate; holds a concurrency slot) before the prompt is tokenized, `CREATE`
(reserves the job's predicted $ within the budget, writes the job) after; `RELEASE` gives the slot and the
rate count back when the request is refused in between.

Budget reservations: `p:tenant:{t}:reserved` (hash, job id -> $ reserved at admission) and
`p:tenant:{t}:reserved_usd` (their sum). Admission counts spend + reserved against the budget; a
reservation ends exactly once (`HDEL` decides): released by a FAILED / CANCELED move, settled when the
job is billed (billing/spend.py: the bill's $ added to spend in the same script)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from prfaas.control_plane.jobs.states import LEGAL_MOVES, TERMINAL, JobState


def _lua_set(states: Iterable[JobState]) -> str:
    return "{" + ", ".join(f"{s.value}=1" for s in sorted(states)) + "}"


def lua_legal_table(moves: Mapping[JobState, frozenset[JobState]]) -> str:
    """`local legal = {...}`: state -> set of the states it may move to, as a Lua table."""
    rows = "".join(f"  {state.value} = {_lua_set(targets)},\n" for state, targets in moves.items())
    return f"local legal = {{\n{rows}}}\nlocal terminal = {_lua_set(TERMINAL)}\n"


# Lua function: end a job's budget reservation, once. Returns 1 when it held one. Resets the sum when no
# reservation is left (INCRBYFLOAT rounding never accumulates).
RELEASE_RESERVATION_FN = """
local function release_reservation(reserved, total, id)
  local usd = redis.call('HGET', reserved, id)
  if not usd then return 0 end
  redis.call('HDEL', reserved, id)
  if redis.call('HLEN', reserved) == 0 then
    redis.call('DEL', total)
  elseif tonumber(redis.call('INCRBYFLOAT', total, '-' .. usd)) < 0 then
    redis.call('SET', total, '0')
  end
  return 1
end
"""

# Lua function: how many of a job's attached readers (jobs/tokenlog.py) still count: their entry's time, on
# Redis's clock, not passed.
LIVE_READERS_FN = """
local function live_readers(attached)
  local t = redis.call('TIME')
  return redis.call('ZCOUNT', attached, tonumber(t[1]) + tonumber(t[2]) / 1000000, '+inf')
end
"""

# KEYS: job, timeline, tenant's active set, tenant's spend, tenant's reservations hash, their sum, tenant's index,
#       the job's token log ('' = none) and its attached readers (jobs/tokenlog.py), the followed-jobs hash
#       ('' = none), the leases' zset and info hash ('' = none).
# ARGV: target state, attempt, now, TTL of a finished job, timeline note, $ to bill at DONE, n, then n
# field/value pairs to set with the move, then the token to log (with KEYS[8]: jobs/tokenlog.py's entry), the
# follower to drop when the move ends the job (with KEYS[10]: only if it is the one following), and the lease to
# grant (with KEYS[11]: job id, deadline, info JSON; jobs/leases.py). Each only if the move is made: a refused
# DONE logs no token (a reader of the log would take the output for complete), a refused retry grants no lease
# (it would replace the newer attempt's). So the last token, DONE and the end of the follow are one round trip,
# and a move to QUEUED and the `queued` lease that guards its dispatch are one step.
# Returns {'ok', state, attempt} or {'not_found' | 'illegal' | 'stale', current state, current attempt}.
# A FAILED / CANCELED move releases the job's budget reservation; DONE keeps it until the job is billed
# (or settles it here when the move itself bills a $).
_TRANSITION_TEMPLATE = """
@LEGAL@@RELEASE@local extra = 8 + 2 * tonumber(ARGV[7])
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
if KEYS[8] ~= '' then
  redis.call('RPUSH', KEYS[8], ARGV[extra])
  redis.call('EXPIRE', KEYS[8], ARGV[4])
  if live_readers(KEYS[9]) > 0 then redis.call('PUBLISH', KEYS[1] .. ':notify', 'token') end
end
if KEYS[11] ~= '' then
  redis.call('ZADD', KEYS[11], ARGV[extra + 3], ARGV[extra + 2])
  redis.call('HSET', KEYS[12], ARGV[extra + 2], ARGV[extra + 4])
end
if terminal[target] then
  local id = redis.call('HGET', KEYS[1], 'id')
  redis.call('SREM', KEYS[3], id)
  local billed = target == 'DONE' and tonumber(ARGV[6]) > 0
  if billed then redis.call('INCRBYFLOAT', KEYS[4], ARGV[6]) end
  if billed or target ~= 'DONE' then release_reservation(KEYS[5], KEYS[6], id) end
  redis.call('EXPIRE', KEYS[1], ARGV[4])
  redis.call('EXPIRE', KEYS[2], ARGV[4])
  -- the tenant's last live job ended: every job its index names expires within the TTL, so may the index
  if redis.call('SCARD', KEYS[3]) == 0 and redis.call('TTL', KEYS[7]) > tonumber(ARGV[4]) then
    redis.call('EXPIRE', KEYS[7], ARGV[4])
  end
  if KEYS[10] ~= '' and redis.call('HGET', KEYS[10], id) == ARGV[extra + 1] then redis.call('HDEL', KEYS[10], id) end
  redis.call('PUBLISH', KEYS[1] .. ':notify', target)
end
return {'ok', target, new_attempt}
"""
TRANSITION = _TRANSITION_TEMPLATE.replace("@LEGAL@", lua_legal_table(LEGAL_MOVES)).replace(
    "@RELEASE@", RELEASE_RESERVATION_FN + LIVE_READERS_FN
)

# KEYS: job. ARGV: attempt, a field whose presence refuses the update ('' = none), then field/value pairs set while
# that attempt is the job's. Returns 1 when set.
UPDATE = """
if redis.call('HGET', KEYS[1], 'attempt') ~= ARGV[1] then return 0 end
if ARGV[2] ~= '' and redis.call('HEXISTS', KEYS[1], ARGV[2]) == 1 then return 0 end
if #ARGV > 2 then redis.call('HSET', KEYS[1], unpack(ARGV, 3)) end
return 1
"""

# Lua function: the job an Idempotency-Key names, and whether the request's body hash matches the one
# stored with it ('id hash'; a value written before hashes were stored matches any body).
_IDEMPOTENCY_FN = """
local function idempotent(key, body_hash)
  local stored = redis.call('GET', key)
  if not stored then return nil end
  local id, hash = string.match(stored, '^(%S+) ?(%S*)$')
  if hash ~= '' and body_hash ~= '' and hash ~= body_hash then return {'idempotency', id} end
  return {'existing', id}
end
"""

# Before tokenizing. KEYS: idempotency key ('' = none), spend, reservations' sum, active set, admitting
# zset (job id -> until when its slot is held), rate window.
# ARGV: job id, now, rps, concurrency, budget, hold until, body hash, TTL of the admitting zset.
# Returns {'admitted', id}, {'existing' | 'idempotency', the key's job id} or {'budget' | 'concurrency' | 'rate', ''}.
ADMIT = (
    _IDEMPOTENCY_FN
    + """
if KEYS[1] ~= '' then
  local found = idempotent(KEYS[1], ARGV[7])
  if found then return found end
end
local used = tonumber(redis.call('GET', KEYS[2]) or '0') + tonumber(redis.call('GET', KEYS[3]) or '0')
if used >= tonumber(ARGV[5]) then return {'budget', ''} end
redis.call('ZREMRANGEBYSCORE', KEYS[5], '-inf', ARGV[2])
if redis.call('SCARD', KEYS[4]) + redis.call('ZCARD', KEYS[5]) >= tonumber(ARGV[4]) then return {'concurrency', ''} end
local count = redis.call('INCR', KEYS[6])
if count == 1 then redis.call('EXPIRE', KEYS[6], 2) end
if count > tonumber(ARGV[3]) then return {'rate', ''} end
redis.call('ZADD', KEYS[5], ARGV[6], ARGV[1])
redis.call('EXPIRE', KEYS[5], ARGV[8])
return {'admitted', ARGV[1]}
"""
)

# Lua function: give an admission's concurrency slot and its rate count back (once: the ZREM decides).
_GIVE_BACK_FN = """
local function give_back(admitting, rate, id)
  if redis.call('ZREM', admitting, id) == 1 and redis.call('EXISTS', rate) == 1 then
    if redis.call('DECR', rate) < 0 then redis.call('SET', rate, '0', 'KEEPTTL') end
  end
end
"""

# An Idempotency-Key's mapping dropped if it still names the job. KEYS: idempotency key. ARGV: job id.
FORGET = """
local stored = redis.call('GET', KEYS[1])
if stored and string.match(stored, '^(%S+)') == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

# A request refused after ADMIT (tokenizing or validation failed). KEYS: admitting zset, rate window. ARGV: job id.
RELEASE = _GIVE_BACK_FN + "give_back(KEYS[1], KEYS[2], ARGV[1])\nreturn 1\n"

# After tokenizing. KEYS: job, timeline, tenant index, active set, admitting zset, rate window, spend,
#       reservations hash, their sum, idempotency key ('' = none), ready list ('' = none), the followed-jobs
#       hash ('' = none: the job is followed by the process whose id is ARGV[start + 3]), the leases' zset and
#       info hash ('' = none)
# ARGV: id, now, budget, $ to reserve, TTL of the job's keys, index entries scored below this are trimmed,
#       TTL of the idempotency key and of the hand-off list, body hash, n, field/value pairs, then the state
#       the job starts in past QUEUED ('' = none), its timeline note, and the hand-off to post (a placement
#       decided at admission: the job is written already handed off), the follower, and the `queued` lease that
#       guards the job's first dispatch (with KEYS[13]: deadline, info JSON; jobs/leases.py): its creator may die
#       before it queues the dispatch, and the sweeper then queues it
# Refusals ('existing' / 'idempotency': a concurrent request with the same key won; 'budget': the
# reservation does not fit) give the admission back. Returns {'created', id} or {refusal, id or ''}.
CREATE = (
    _IDEMPOTENCY_FN
    + _GIVE_BACK_FN
    + """
if KEYS[10] ~= '' then
  local found = idempotent(KEYS[10], ARGV[8])
  if found then
    give_back(KEYS[5], KEYS[6], ARGV[1])
    return found
  end
end
local used = tonumber(redis.call('GET', KEYS[7]) or '0') + tonumber(redis.call('GET', KEYS[9]) or '0')
local budget, reserve = tonumber(ARGV[3]), tonumber(ARGV[4])
if used >= budget or used + reserve > budget then
  give_back(KEYS[5], KEYS[6], ARGV[1])
  return {'budget', ''}
end
redis.call('ZREM', KEYS[5], ARGV[1])
local n = tonumber(ARGV[9])
for i = 1, n do redis.call('HSET', KEYS[1], ARGV[9 + 2 * i - 1], ARGV[9 + 2 * i]) end
redis.call('RPUSH', KEYS[2], cjson.encode({state='QUEUED', attempt=1, at=tonumber(ARGV[2]), note='created'}))
local start = 10 + 2 * n
if ARGV[start] ~= '' then
  redis.call('RPUSH', KEYS[2], cjson.encode({state=ARGV[start], attempt=1, at=tonumber(ARGV[2]), note=ARGV[start + 1]}))
end
redis.call('EXPIRE', KEYS[1], ARGV[5])
redis.call('EXPIRE', KEYS[2], ARGV[5])
if KEYS[11] ~= '' then
  redis.call('RPUSH', KEYS[11], ARGV[start + 2])
  redis.call('EXPIRE', KEYS[11], ARGV[7])
end
redis.call('ZADD', KEYS[3], ARGV[2], ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', '(' .. ARGV[6])
redis.call('EXPIRE', KEYS[3], ARGV[5])  -- the index lives as long as its newest job's keys
redis.call('SADD', KEYS[4], ARGV[1])
if reserve > 0 then
  redis.call('HSET', KEYS[8], ARGV[1], ARGV[4])
  redis.call('INCRBYFLOAT', KEYS[9], ARGV[4])
end
if KEYS[10] ~= '' then redis.call('SET', KEYS[10], ARGV[1] .. ' ' .. ARGV[8], 'EX', ARGV[7]) end
if KEYS[12] ~= '' then redis.call('HSET', KEYS[12], ARGV[1], ARGV[start + 3]) end
if KEYS[13] ~= '' then
  redis.call('ZADD', KEYS[13], ARGV[start + 4], ARGV[1])
  redis.call('HSET', KEYS[14], ARGV[1], ARGV[start + 5])
end
return {'created', ARGV[1]}
"""
)
