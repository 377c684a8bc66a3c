"""The token log of a job: what its follower streamed, a Redis list of [token, last, finish
reason, stop reason, logprobs] whose index is the token's (`p:job:{id}:tokens`). A request that attaches to a running
job (an Idempotency-Key retry) reads its tokens from here instead of decoding again; attached
readers are woken through the job's notify channel, which the log publishes to only while someone
is attached. Each attached reader is an entry of `p:job:{id}:attached` (a sorted set: reader id ->
until when it counts, Redis time), renewed while it reads and removed when it ends: a reader whose
process died stops counting `reader_s` after its last renewal (a counter it would never have
decremented kept the job running for nobody, its own client gone). Both keys live `job.ttl_s`."""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

from prfaas.control_plane.jobs.errors import JobNotFound
from prfaas.control_plane.jobs.scripts import LIVE_READERS_FN
from prfaas.control_plane.jobs.states import TERMINAL
from prfaas.control_plane.jobs.store import JobStore
from prfaas.engine.sampling import TokenLogprobs


@dataclass(frozen=True)
class Token:
    """One token of a job's output, as its decode region streamed it."""

    index: int
    token: int
    last: bool
    finish_reason: str  # on the last: "length", "eos", "stop_token" or "stop" (a stop string)
    stop_reason: str = ""  # "stop": the stop string; "stop_token": the token id
    logprobs: TokenLogprobs | None = None
    choice: int = 0  # which of the job's `n` choices; `index` and `last` are that choice's
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()  # on choice 0's token 0, when asked (echo)

    def entry(self) -> str:
        prompt = [_lp_entry(p) for p in self.prompt_logprobs]
        return json.dumps([self.token, int(self.last), self.finish_reason, self.stop_reason, _lp_entry(self.logprobs),
                           self.choice, self.index, prompt])  # fmt: skip

    @staticmethod
    def of_entry(position: int, entry: Any) -> Token:
        """A log entry read back (`position`: its place in the log, the index of a one-choice job's token)."""
        token, last, finish, *more = json.loads(entry)
        # older entries end early: their missing fields take these defaults
        stop, lp, choice, index, prompt = [*more, *["", None, 0, position, []][len(more) :]][:5]
        logprobs = _lp_of(lp)
        prompt_logprobs = tuple(p for p in (_lp_of(e) for e in prompt) if p is not None)
        return Token(int(index), int(token), bool(last), str(finish), str(stop), logprobs, int(choice), prompt_logprobs)


def _lp_entry(lp: TokenLogprobs | None) -> list[Any] | None:
    return None if lp is None else [lp.logprob, lp.rank, list(lp.top_ids), list(lp.top_logprobs)]


def _lp_of(entry: list[Any] | None) -> TokenLogprobs | None:
    return None if entry is None else TokenLogprobs(entry[0], entry[1], tuple(entry[2]), tuple(entry[3]))


# KEYS: token log, attached readers, notify channel, the job's record. ARGV: entry, TTL. Returns 0, logging
# nothing, when the record is gone (a Redis that came back empty): the job is lost, its decode is not worth going on.
_LOG_TOKEN = (
    LIVE_READERS_FN
    + """
if redis.call('EXISTS', KEYS[4]) == 0 then return 0 end
redis.call('RPUSH', KEYS[1], ARGV[1])
redis.call('EXPIRE', KEYS[1], ARGV[2])
if live_readers(KEYS[2]) > 0 then redis.call('PUBLISH', KEYS[3], 'token') end
return 1
"""
)

# KEYS: attached readers. ARGV: reader id, seconds it counts from now (0: it leaves), TTL of the key. Drops the
# entries of readers that stopped counting, so those left are the ones that count. Returns how many.
_READER = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if tonumber(ARGV[2]) > 0 then
  redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
  redis.call('EXPIRE', KEYS[1], ARGV[3])
else
  redis.call('ZREM', KEYS[1], ARGV[1])
end
return redis.call('ZCARD', KEYS[1])
"""
_READERS = LIVE_READERS_FN + "return live_readers(KEYS[1])\n"


class TokenLog:
    def __init__(self, jobs: JobStore) -> None:
        self.redis: Any = jobs.redis
        self.settings = jobs.settings
        self.notifier = jobs.notifier
        self._log = jobs.redis.register_script(_LOG_TOKEN)
        self._reader = jobs.redis.register_script(_READER)
        self._readers = jobs.redis.register_script(_READERS)
        # an attached reader counts this long after its last renewal, and renews every `beat_s` while it reads: a
        # reader held up longer (its client reads slowly) may find the job canceled if the job's own client left
        self.reader_s = 10 * self.settings.dead_after_s

    def log_token(self, job_id: str, token: Token) -> None:
        """Append the job's next token (its index is its place in the log); wakes attached
        readers, if any (a job nobody attached to publishes nothing). JobNotFound, logging nothing, when the
        job's record is gone (Redis came back empty): before, its decode ran on to the last token for nobody."""
        key = self.settings.key("job", job_id)
        args = [token.entry(), self.settings.job.ttl_s]
        if not self._log(keys=[key + ":tokens", key + ":attached", key + ":notify", key], args=args):
            raise JobNotFound(job_id)

    def logged_tokens(self, job_id: str, start: int) -> list[Token]:
        """The logged tokens from index `start` on."""
        items = self.redis.lrange(self.settings.key("job", job_id) + ":tokens", start, -1)
        return [Token.of_entry(start + i, item) for i, item in enumerate(items)]

    def attach(self, job_id: str, reader: str) -> int:
        """Count `reader` (a name no other reader has) among the job's attached readers for `reader_s` from now:
        called again to renew it. -> how many count now."""
        return self._attach(job_id, reader, self.reader_s)

    def detach(self, job_id: str, reader: str) -> int:
        """`reader` no longer reads the job; -> how many still count."""
        return self._attach(job_id, reader, 0.0)

    def _attach(self, job_id: str, reader: str, count_s: float) -> int:
        key = self.settings.key("job", job_id) + ":attached"
        return int(self._reader(keys=[key], args=[reader, count_s, self.settings.job.ttl_s]))

    def readers(self, job_id: str) -> int:
        """How many attached readers count now."""
        return int(self._readers(keys=[self.settings.key("job", job_id) + ":attached"]))

    def wait_tokens(self, job_id: str, start: int, timeout_s: float) -> list[Token]:
        """Tokens from index `start` on, waiting up to `timeout_s` for some; [] at the deadline
        or when the job ended with no more logged (the caller reads its state)."""
        deadline = time.monotonic() + timeout_s
        channel = self.settings.key("job", job_id) + ":notify"
        notified = self.notifier.watch(channel)
        try:
            while True:
                notified.clear()
                found = self.logged_tokens(job_id, start)
                if found:
                    return found
                state = self.redis.hget(self.settings.key("job", job_id), "state")
                remaining = deadline - time.monotonic()
                if state is None or _text(state) in TERMINAL or remaining <= 0:
                    return self.logged_tokens(job_id, start)  # a last one may have come with the end
                notified.wait(min(remaining, 1.0 if self.notifier.live else 0.02))
        finally:
            self.notifier.unwatch(channel, notified)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


STALL_GAP_S = 1.0  # a gap between two tokens of a stream over this is its region stalling (a decode step: ms) ...
STALL_STEPS = 10  # ... when it is also over this many of the stream's steps (a slow region's steps are not stalls)


@dataclass(frozen=True)
class StreamTiming:
    """One decode stream's timing, on its region's clock: its token 0 (wall time here, elapsed s there), its
    latest token (elapsed s), and its stalls (not billed). A stall: a gap between two tokens of a choice over
    `STALL_GAP_S` and over `STALL_STEPS` of the stream's steps (the mean of the choices' other gaps; a gap before
    any step is a step); what is not billed of it is the stream's time since its previous token of any choice,
    less one step (the step that made the token after the stall)."""

    attempt: int
    first_at: float
    first_s: float
    last_s: float
    stall_s: float
    steps: int = 0  # the choices' gaps that were not stalls ...
    stepped_s: float = 0.0  # ... and their sum
    lasts: tuple[tuple[int, float], ...] = ()  # each choice's latest token (elapsed s)

    def served(self) -> dict[str, float]:
        """The DONE record's fields: billing/usage.py bills `gen_last_s - gen_first_s - gen_stall_s`."""
        return {"first_token_at": self.first_at, "gen_first_s": self.first_s, "gen_last_s": self.last_s,
                "gen_stall_s": self.stall_s}  # fmt: skip


class Outputs:
    """A job's output as its follower has it: each choice's tokens and whether it ended."""

    def __init__(self, tokens: Iterable[Token]) -> None:
        self.tokens: dict[int, list[int]] = {}
        self.ended: dict[int, Token] = {}  # choice -> its last token
        self.timing: StreamTiming | None = None  # of the stream now read: what a cut output is billed
        for token in tokens:
            self.add(token)

    def add(self, token: Token) -> bool:
        """Record `token`; False when its choice already has it (a new attempt repeats what was sent)."""
        tokens = self.tokens.setdefault(token.choice, [])
        if token.index < len(tokens):
            return False
        tokens.append(token.token)
        if token.last:
            self.ended[token.choice] = token
        return True

    def undo(self, token: Token) -> None:
        """Forget `token`, the last one `add` recorded of its choice (it was not sent after all)."""
        tokens = self.tokens.get(token.choice, [])
        if tokens and token.index == len(tokens) - 1:
            tokens.pop()
            if self.ended.get(token.choice) is token:
                del self.ended[token.choice]

    @property
    def count(self) -> int:
        return sum(len(t) for t in self.tokens.values())

    def done(self, n: int) -> bool:
        return len(self.ended) >= n

    def timed(self, attempt: int, first: tuple[float, float], elapsed_s: float, choice: int = 0) -> StreamTiming:
        """A token came at `elapsed_s` on the stream of `attempt` whose token 0 came at `first` (wall time, elapsed
        s): that stream's timing so far (`timing`), a stall of its region counted (`StreamTiming`: the region
        stopped, the job used no GPU time but one step's)."""
        t = self.timing
        if t is None or (t.attempt, t.first_at, t.first_s) != (attempt, *first):
            self.timing = StreamTiming(attempt, first[0], first[1], elapsed_s, 0.0, lasts=((choice, elapsed_s),))
            return self.timing
        lasts, stream_last = dict(t.lasts), t.last_s
        previous = lasts.get(choice)
        lasts[choice] = elapsed_s
        t = replace(t, last_s=max(t.last_s, elapsed_s), lasts=tuple(sorted(lasts.items())))
        if previous is not None:
            gap = max(0.0, elapsed_s - previous)
            step = t.stepped_s / t.steps if t.steps else gap
            if gap > max(STALL_GAP_S, STALL_STEPS * step):  # of the stream's time, only what this token waited
                t = replace(t, stall_s=t.stall_s + max(0.0, elapsed_s - stream_last - step))
            else:
                t = replace(t, steps=t.steps + 1, stepped_s=t.stepped_s + gap)
        self.timing = t
        return t

    def cut(self) -> dict[str, Any]:
        """The record of an output cut short (the job ended before DONE: billing/usage.py bills it when its client
        canceled it): the tokens its follower got, and the timing of the stream that brought the last."""
        t = self.timing
        if t is None or not self.count:
            return {}
        return {"cut_tokens": self.count, "cut_attempt": t.attempt, "cut_first_at": t.first_at,
                "cut_first_s": t.first_s, "cut_last_s": t.last_s, "cut_stall_s": t.stall_s}  # fmt: skip

    def record(self) -> dict[str, Any]:
        """The DONE record's fields: completion tokens over every choice; a one-choice job's output ids,
        finish and stop reason as they are, an n-choice job's as lists by choice."""
        choices = sorted(self.tokens)
        if choices == [0]:
            last = self.ended[0]
            return {"completion_tokens": self.count, "output_ids": self.tokens[0], "finish_reason": last.finish_reason,
                    "stop_reason": last.stop_reason}  # fmt: skip
        return {
            "completion_tokens": self.count, "output_ids": [self.tokens[c] for c in choices],
            "finish_reason": self.ended[0].finish_reason, "stop_reason": self.ended[0].stop_reason,
            "finish_reasons": [self.ended[c].finish_reason for c in choices],
            "stop_reasons": [self.ended[c].stop_reason for c in choices],
        }  # fmt: skip


def recorded_tokens(job: dict[str, str]) -> list[Token]:
    """A DONE job's tokens from its record (`Outputs.record`), for a reader that came after its log expired."""
    output = json.loads(job.get("output_ids") or "[]")
    if output and isinstance(output[0], list):  # n choices
        finishes = json.loads(job.get("finish_reasons") or "[]")
        stops = json.loads(job.get("stop_reasons") or "[]")
        per_choice = list(zip(output, finishes, stops, strict=False))
    else:
        per_choice = [(output, job.get("finish_reason", ""), job.get("stop_reason", ""))]
    tokens = []
    for choice, (ids, finish, stop) in enumerate(per_choice):
        for index, token in enumerate(ids):
            last = index == len(ids) - 1
            tokens.append(Token(index, int(token), last, finish if last else "", stop if last else "", None, choice))
    return tokens
