"""The job store's Lua scripts: each state change and each admission is one script, atomic in Redis.

`TRANSITION` is generated from the state machine's table (jobs/states.py: `LEGAL_MOVES`, `TERMINAL`), so
the legal moves are written once, in Python. `CREATE` admits a job (idempotency, budget, concurrency,
rate) and writes it in the same step."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from prfaas.control_plane.jobs.states import LEGAL_MOVES, TERMINAL, JobState


def _lua_set(states: Iterable[JobState]) -> str:
    return "{" + ", ".join(f"{s.value}=1" for s in sorted(states)) + "}"


def lua_legal_table(moves: Mapping[JobState, frozenset[JobState]]) -> str:
    """`local legal = {...}`: state -> set of the states it may move to, as a Lua table."""
    rows = "".join(f"  {state.value} = {_lua_set(targets)},\n" for state, targets in moves.items())
    return f"local legal = {{\n{rows}}}\nlocal terminal = {_lua_set(TERMINAL)}\n"


# KEYS: job, timeline, tenant's active set, tenant's spend. ARGV: target state, attempt, now, TTL of a
# finished job, timeline note, $ to bill at DONE, n, then n field/value pairs to set with the move.
# Returns {'ok', state, attempt} or {'not_found' | 'illegal' | 'stale', current state, current attempt}.
_TRANSITION_TEMPLATE = """
@LEGAL@local cur = redis.call('HMGET', KEYS[1], 'state', 'attempt')
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
if terminal[target] then
  redis.call('SREM', KEYS[3], redis.call('HGET', KEYS[1], 'id'))
  if target == 'DONE' and tonumber(ARGV[6]) > 0 then redis.call('INCRBYFLOAT', KEYS[4], ARGV[6]) end
  redis.call('EXPIRE', KEYS[1], ARGV[4])
  redis.call('EXPIRE', KEYS[2], ARGV[4])
  redis.call('PUBLISH', KEYS[1] .. ':notify', target)
end
return {'ok', target, new_attempt}
"""
TRANSITION = _TRANSITION_TEMPLATE.replace("@LEGAL@", lua_legal_table(LEGAL_MOVES))

# KEYS: job, timeline, tenant index, active set, spend, rate window, idempotency key ('' = none),
#       ready list ('' = none)
# ARGV: id, now, rps, concurrency, budget, ttl, n, field/value pairs, then the state the job
#       starts in past QUEUED ('' = none), its timeline note, and the hand-off to post
#       (a placement decided at admission: the job is written already handed off)
CREATE = """
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
