"""Workloads: arrival processes, length distributions, the long-context agentic mix and JSONL
trace replay. Every generator is a pure function of its seed."""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol


@dataclass(frozen=True)
class Arrival:
    at_s: float
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int = 0  # prompt prefix already in the decode region's cache
    # Modelled prefix caches (sim/prefix.py): the names of the prompt's full blocks of `block_tokens`, and
    # those a decode region keeps after the reply (the prompt's and the reply's); empty: `cached_tokens` says
    prefix: tuple[str, ...] = ()
    kept: tuple[str, ...] = ()
    block_tokens: int = 0


@dataclass(frozen=True)
class LengthDist:
    """Log-normal token count with the given mean and coefficient of variation, clipped."""

    mean: float
    cv: float = 1.0
    lo: int = 1
    hi: int = 1_000_000

    def sample(self, rng: random.Random) -> int:
        if self.cv <= 0:
            return max(self.lo, min(self.hi, round(self.mean)))
        sigma2 = math.log1p(self.cv**2)
        mu = math.log(self.mean) - sigma2 / 2
        return max(self.lo, min(self.hi, round(rng.lognormvariate(mu, math.sqrt(sigma2)))))


@dataclass(frozen=True)
class TruncatedLogNormal:
    """exp(N(mu, sigma)) conditioned on [lo, hi] (redrawn until inside; not clipped), rounded."""

    mu: float
    sigma: float
    lo: int
    hi: int

    def __post_init__(self) -> None:
        if not 1 <= self.lo <= self.hi or self.sigma < 0:
            raise ValueError("need 1 <= lo <= hi and sigma >= 0")
        if self.sigma == 0:
            if not self.lo <= round(math.exp(self.mu)) <= self.hi:
                raise ValueError("exp(mu) is outside [lo, hi]")
            return
        z_hi, z_lo = ((math.log(v) - self.mu) / self.sigma for v in (self.hi + 0.5, self.lo - 0.5))
        if _normal_cdf(z_hi) - _normal_cdf(z_lo) < 1e-3:
            raise ValueError("[lo, hi] holds under 0.1% of the distribution")

    def sample(self, rng: random.Random) -> int:
        while True:
            value = round(rng.lognormvariate(self.mu, self.sigma))
            if self.lo <= value <= self.hi:
                return value


def _normal_cdf(z: float) -> float:
    return 0.5 * math.erfc(-z / math.sqrt(2.0))


class Lengths(Protocol):
    def sample(self, rng: random.Random) -> int: ...


class ArrivalSource(Protocol):
    """What a scenario draws its requests from (`Workload`, `MultiTurn`)."""

    def generate(self, rate_rps: float, num_requests: int, seed: int) -> list[Arrival]: ...


@dataclass(frozen=True)
class MixClass:
    weight: float
    prompt: Lengths
    output: Lengths
    cached_share: float = 0.0  # share of the prompt that hits the prefix cache


@dataclass(frozen=True)
class Workload:
    """`rate_rps` arrivals per second; `burstiness` is the CV of inter-arrival gaps (1: Poisson,
    >1: burstier gamma arrivals); requests drawn from `mix` by weight."""

    mix: tuple[MixClass, ...]
    burstiness: float = 1.0

    def generate(self, rate_rps: float, num_requests: int, seed: int) -> list[Arrival]:
        if rate_rps <= 0:
            raise ValueError("rate_rps must be positive")
        rng = random.Random(seed)
        shape = 1.0 / self.burstiness**2  # gamma: CV = 1 / sqrt(shape)
        scale = 1.0 / (rate_rps * shape)
        weights = [c.weight for c in self.mix]
        now = 0.0
        out: list[Arrival] = []
        for _ in range(num_requests):
            now += rng.gammavariate(shape, scale)
            cls = rng.choices(self.mix, weights)[0]
            prompt = cls.prompt.sample(rng)
            out.append(Arrival(now, prompt, cls.output.sample(rng), int(prompt * cls.cached_share)))
        return out


def chat_workload() -> Workload:
    return Workload((MixClass(1.0, LengthDist(2_000, 1.0, 16, 32_000), LengthDist(300, 0.8, 8, 4_000)),))


def agentic_long_context_mix() -> Workload:
    """Agentic coding sessions: long tool-laden contexts with a warm system prefix, short turns
    in between, a few cold long documents (the PrfaaS-style long-context mix)."""
    return Workload(
        (
            MixClass(0.45, LengthDist(48_000, 0.6, 4_000, 128_000), LengthDist(600, 0.8, 16, 8_000), 0.1),
            MixClass(0.35, LengthDist(6_000, 0.8, 256, 32_000), LengthDist(300, 0.8, 8, 4_000), 0.3),
            MixClass(0.20, LengthDist(96_000, 0.3, 32_000, 128_000), LengthDist(1_000, 0.6, 16, 8_000)),
        ),
        burstiness=1.5,
    )


def prfaas_paper_workload() -> Workload:
    """The PrfaaS case study's workload (arXiv 2604.15039, §4.1): input lengths log-normal
    (mu 9.90, sigma 1.00) truncated to [128, 128K] (mean ~27K tokens), output fixed at 1024
    tokens, no prefix-cache hits; its throughput model assumes uniform arrivals, here Poisson."""
    return Workload((MixClass(1.0, TruncatedLogNormal(9.90, 1.00, 128, 131_072), LengthDist(1024, 0.0)),))


def load_trace(path: str | Path) -> list[Arrival]:
    """JSONL, one request a line: `t_s` (arrival offset, s), `prompt_tokens`, `output_tokens`
    (or `max_new_tokens`), optional `cached_tokens`. Lines are sorted by `t_s`, and the times shifted so
    the first request arrives at 0 s: a window cut out of a longer log, or a trace in epoch seconds,
    replays as the same run (the simulated clock then stays small, where a float still resolves a
    microsecond). A file that cannot be read, holds no request, or has a row no request could have is a
    ValueError naming it."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: cannot read the trace ({exc})") from None
    rows: list[Arrival] = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            doc = json.loads(line)
            output = doc["output_tokens"] if "output_tokens" in doc else doc["max_new_tokens"]
            row = Arrival(float(doc["t_s"]), int(doc["prompt_tokens"]), int(output), int(doc.get("cached_tokens", 0)))
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            raise ValueError(f"{path}:{number}: bad trace row ({exc!r})") from None
        if not (math.isfinite(row.at_s) and row.at_s >= 0 and row.prompt_tokens >= 1 and row.output_tokens >= 1):
            raise ValueError(
                f"{path}:{number}: a request needs t_s >= 0 (finite), prompt_tokens >= 1, output_tokens >= 1"
            )
        if not 0 <= row.cached_tokens < row.prompt_tokens:
            raise ValueError(f"{path}:{number}: cached_tokens must be in [0, prompt_tokens)")
        rows.append(row)
    if not rows:
        raise ValueError(f"{path}: the trace holds no request")
    first = min(row.at_s for row in rows)
    return sorted((replace(row, at_s=row.at_s - first) for row in rows), key=lambda a: a.at_s)


def scale_rate(arrivals: list[Arrival], factor: float) -> list[Arrival]:
    """The same trace replayed `factor` times faster."""
    return [Arrival(a.at_s / factor, a.prompt_tokens, a.output_tokens, a.cached_tokens) for a in arrivals]


@dataclass(frozen=True)
class MultiTurn:
    """Conversations (`prfaas bench --mix multiturn`'s shape): a system prompt every conversation
    shares, then `turns` turns each re-sending the history (the system prompt, every earlier user
    message and reply) with a new user message. Conversations start as Poisson arrivals at
    rate / turns (so requests arrive at `rate_rps`), a turn `think_s` after the one before (the
    reply and the user's pause). Prompts are chains of named blocks (sim/prefix.py)."""

    turns: int = 4
    system_tokens: int = 4_096
    user: Lengths = LengthDist(400, 0.6, 16, 8_000)
    output: Lengths = LengthDist(300, 0.8, 8, 2_000)
    think_s: float = 30.0
    block_tokens: int = 64

    def generate(self, rate_rps: float, num_requests: int, seed: int) -> list[Arrival]:
        if rate_rps <= 0:
            raise ValueError("rate_rps must be positive")
        rng = random.Random(seed)
        out: list[Arrival] = []
        start, conversation = 0.0, 0
        while len(out) < num_requests:
            start += rng.expovariate(rate_rps / self.turns)
            history = self.system_tokens
            for turn in range(min(self.turns, num_requests - len(out))):
                prompt = history + self.user.sample(rng)
                reply = self.output.sample(rng)
                out.append(Arrival(start + turn * self.think_s, prompt, reply, 0, self._chain(conversation, prompt),
                                   self._chain(conversation, prompt + reply - 1), self.block_tokens))  # fmt: skip
                history = prompt + reply
            conversation += 1
        return sorted(out, key=lambda a: a.at_s)

    def _chain(self, conversation: int, tokens: int) -> tuple[str, ...]:
        """Names of the full blocks of `tokens` tokens of this conversation: the system prompt's shared."""
        shared = self.system_tokens // self.block_tokens
        return tuple(f"s{i}" if i < shared else f"c{conversation}.{i}" for i in range(tokens // self.block_tokens))
