"""What `prfaas bench` sends: arrival times, prompt and output lengths, shared prefixes.

Pure functions of a seed (the same seed gives the same requests, so `--compare` runs one
workload under each policy). Length specs: `fixed:N`, `uniform:LO-HI`, `lognormal:MEDIAN,SIGMA`
(natural-log sigma in [0, `MAX_SIGMA`], every draw clipped to [1, the model's limit]); named mixes in `MIXES`.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass


class WorkloadError(ValueError):
    """A workload option that cannot be used; the message names the option."""


MAX_SIGMA = 10.0  # lognormal: past it one draw in 100 is e^23 (1e10) times the median; a typo, not a workload


@dataclass(frozen=True)
class Lengths:
    kind: str  # fixed | uniform | lognormal
    a: float
    b: float = 0.0

    def sample(self, rng: random.Random, hi: int) -> int:
        if self.kind == "fixed":
            value = self.a
        elif self.kind == "uniform":
            value = rng.uniform(self.a, self.b)
        else:  # lognormvariate's draw, capped in log space: exp() of a long tail's draw overflows
            value = math.exp(min(rng.normalvariate(math.log(self.a), self.b), math.log(hi + 1)))
        if not math.isfinite(value):  # a Lengths built by hand with nan or inf: the limit
            return hi
        return max(1, min(hi, round(value)))


def parse_lengths(spec: str, option: str) -> Lengths:
    """`fixed:128`, `uniform:32-512`, `lognormal:300,0.6` -> `Lengths`."""
    kind, _, args = spec.partition(":")
    try:
        if kind == "fixed":
            result = Lengths("fixed", float(int(args)))
        elif kind == "uniform":
            lo, _, hi = args.partition("-")
            result = Lengths("uniform", float(int(lo)), float(int(hi)))
            if result.a > result.b:
                raise ValueError
        elif kind == "lognormal":
            median, _, sigma = args.partition(",")
            result = Lengths("lognormal", float(median), float(sigma))
        else:
            raise ValueError
    except ValueError:
        raise WorkloadError(
            f"{option}: {spec!r} is not fixed:N, uniform:LO-HI or lognormal:MEDIAN,SIGMA (positive numbers)"
        ) from None
    if not (math.isfinite(result.a) and math.isfinite(result.b)):  # float() reads nan, inf and 1e400 (inf)
        raise WorkloadError(f"{option}: {spec!r}: MEDIAN and SIGMA must be finite numbers")
    if not result.a >= 1:
        raise WorkloadError(f"{option}: {spec!r}: lengths start at 1 token")
    if result.kind == "lognormal" and not 0 <= result.b <= MAX_SIGMA:
        raise WorkloadError(f"{option}: {spec!r}: SIGMA must be between 0 and {MAX_SIGMA:g} (natural log)")
    return result


@dataclass(frozen=True)
class RequestClass:
    name: str
    weight: float
    prompt: Lengths
    output: Lengths


# Short chat turns beside long-context RAG / agent prompts; lengths fit small CPU models
# (prompts are clipped to the model's context anyway).
MIXES: dict[str, tuple[RequestClass, ...]] = {
    "chat-rag": (
        RequestClass("chat", 0.7, Lengths("uniform", 16, 128), Lengths("uniform", 8, 32)),
        RequestClass("rag", 0.3, Lengths("lognormal", 1024, 0.3), Lengths("uniform", 8, 24)),
    ),
    "chat-agent": (
        RequestClass("chat", 0.6, Lengths("uniform", 16, 128), Lengths("uniform", 8, 32)),
        RequestClass("agent", 0.4, Lengths("lognormal", 1536, 0.4), Lengths("uniform", 4, 16)),
    ),
    # conversations (loadgen/conversations.py): each turn's new user message and its reply
    "multiturn": (RequestClass("turn", 1.0, Lengths("lognormal", 96, 0.3), Lengths("uniform", 16, 32)),),
}


@dataclass(frozen=True)
class Planned:
    index: int
    at_s: float  # scheduled send time from the run's start; 0 for closed-loop runs
    klass: str
    prompt: tuple[int, ...]
    max_tokens: int
    prefix_group: int | None  # which shared prefix (None: none)
    shared_prefix_tokens: int


MAX_DURATION_S = 3600.0  # default cap on an open loop's last planned arrival, s


def _positive(value: float) -> bool:
    return math.isfinite(value) and value > 0  # nan and inf are refused too


def check_arrival(spec: WorkloadSpec, at_s: float) -> None:
    """Refuse a plan with an arrival past `spec.max_duration_s` (a tiny --rate would plan it days away)."""
    if at_s > spec.max_duration_s:
        raise WorkloadError(
            f"--max-duration-s: at --rate {spec.rate_rps} the plan's arrivals run past {spec.max_duration_s:g} s "
            f"(one at {at_s:.0f} s); raise --rate, lower --num-requests or raise --max-duration-s"
        )


@dataclass(frozen=True)
class WorkloadSpec:
    num_requests: int
    rate_rps: float | None  # None: closed loop at `concurrency`
    burstiness: float = 1.0  # CV of inter-arrival gaps: 1 Poisson, > 1 burstier (gamma)
    input_len: str = "fixed:256"
    output_len: str = "fixed:16"
    mix: str | None = None
    shared_prefix_tokens: int = 0
    prefix_groups: int = 1
    seed: int = 0
    max_duration_s: float = MAX_DURATION_S  # open loop: the latest planned arrival allowed

    def validate(self) -> None:
        if self.num_requests < 1:
            raise WorkloadError("--num-requests: at least 1")
        if self.rate_rps is not None and not _positive(self.rate_rps):
            raise WorkloadError(f"--rate: requests per second must be a positive number, not {self.rate_rps}")
        if not _positive(self.burstiness):
            raise WorkloadError(f"--burstiness: the CV of gaps must be a positive number, not {self.burstiness}")
        if not _positive(self.max_duration_s):
            raise WorkloadError(f"--max-duration-s: seconds must be a positive number, not {self.max_duration_s}")
        if self.mix is not None and self.mix not in MIXES:
            raise WorkloadError(f"--mix: unknown mix {self.mix!r}; known: {', '.join(MIXES)}")
        if self.shared_prefix_tokens < 0 or self.prefix_groups < 1:
            raise WorkloadError("--shared-prefix must be >= 0 and --prefix-groups >= 1")
        parse_lengths(self.input_len, "--input-len")
        parse_lengths(self.output_len, "--output-len")


def plan(spec: WorkloadSpec, corpus: list[int], max_prompt_tokens: int) -> list[Planned]:
    """The requests of one run. `corpus`: real token ids prompts are cut from (cycled)."""
    spec.validate()
    if spec.mix == "multiturn":
        raise WorkloadError("--mix multiturn plans conversations (loadgen/conversations.py), not single requests")
    if len(corpus) < 2:
        raise WorkloadError("the prompt corpus is empty")
    rng = random.Random(spec.seed)
    classes = MIXES[spec.mix] if spec.mix else (
        RequestClass("fixed", 1.0, parse_lengths(spec.input_len, "--input-len"),
                     parse_lengths(spec.output_len, "--output-len")),
    )  # fmt: skip
    shared = min(spec.shared_prefix_tokens, max_prompt_tokens - 1)
    prefixes = [cut(corpus, rng.randrange(len(corpus)), shared) for _ in range(spec.prefix_groups)]
    shape = 1.0 / spec.burstiness**2  # gamma: CV = 1 / sqrt(shape)
    now, out = 0.0, []
    for i in range(spec.num_requests):
        if spec.rate_rps is not None:
            now += rng.gammavariate(shape, 1.0 / (spec.rate_rps * shape))
            check_arrival(spec, now)
        klass = rng.choices(classes, [c.weight for c in classes])[0]
        length = max(klass.prompt.sample(rng, max_prompt_tokens), shared + 1)
        group = rng.randrange(spec.prefix_groups) if shared else None
        head = prefixes[group] if group is not None else ()
        body = cut(corpus, rng.randrange(len(corpus)), length - len(head))
        out.append(Planned(i, now, klass.name, head + body, klass.output.sample(rng, 1 << 20), group, len(head)))
    return out


def cut(corpus: list[int], start: int, n: int) -> tuple[int, ...]:
    return tuple(corpus[(start + k) % len(corpus)] for k in range(n))
