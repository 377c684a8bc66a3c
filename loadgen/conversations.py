"""Multi-turn conversations for `prfaas bench --mix multiturn`: a system prompt every
conversation shares, then turns that each re-send the whole conversation so far (system
prompt, every earlier user message and reply, the new user message), as a chat client does.

Planned from a seed like the other workloads: each conversation's user messages and reply
lengths are fixed in advance; the replies themselves are the deployment's, so a turn's
prompt is known only once the turn before it answered. A reply joins the history as its text
tokenized again by the model's tokenizer, which is what the API does with a chat history.
Between turns a user thinks for `think_s` (and the regions' caches publish what they hold).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from prfaas.loadgen.workload import MIXES, WorkloadError, WorkloadSpec, check_arrival, cut

CONVERSATIONAL = frozenset({"multiturn"})  # mixes planned as conversations
TURNS = 4
SYSTEM_TOKENS = 1024  # when the spec's shared_prefix_tokens is 0
THINK_S = 1.0


@dataclass(frozen=True)
class Conversation:
    index: int
    start_s: float  # from the run's start (0 in a closed loop)
    system: tuple[int, ...]  # shared by every conversation of the run
    users: tuple[tuple[int, ...], ...]  # each turn's new user message
    max_tokens: tuple[int, ...]  # each turn's reply length limit


def plan_conversations(
    spec: WorkloadSpec, corpus: list[int], max_prompt_tokens: int, turns: int = TURNS
) -> list[Conversation]:
    """`spec.num_requests` turns in conversations of `turns` turns (the last may be shorter), in open
    loop starting at `spec.rate_rps / turns` per second (about `rate_rps` requests/s offered); the
    system prompt is `spec.shared_prefix_tokens` long (SYSTEM_TOKENS when 0); a conversation whose
    history would pass `max_prompt_tokens` ends early (the client stops it)."""
    spec.validate()
    if spec.mix not in CONVERSATIONAL:
        raise WorkloadError(f"--mix {spec.mix!r} is not a conversation mix ({', '.join(sorted(CONVERSATIONAL))})")
    if turns < 1:
        raise WorkloadError("--turns: at least 1")
    rng = random.Random(spec.seed)
    (klass,) = MIXES[spec.mix]
    system_len = min(spec.shared_prefix_tokens or SYSTEM_TOKENS, max_prompt_tokens // 2)
    system = cut(corpus, rng.randrange(len(corpus)), system_len)
    shape = 1.0 / spec.burstiness**2
    # open loop: --rate counts requests, so conversations of `turns` turns start at rate / turns per second
    conversations_per_s = spec.rate_rps / turns if spec.rate_rps is not None else None
    now, left = 0.0, spec.num_requests
    out: list[Conversation] = []
    while left > 0:
        if conversations_per_s is not None:
            now += rng.gammavariate(shape, 1.0 / (conversations_per_s * shape))
            check_arrival(spec, now)
        count = min(turns, left)
        users = tuple(cut(corpus, rng.randrange(len(corpus)), klass.prompt.sample(rng, max_prompt_tokens // 8))
                      for _ in range(count))  # fmt: skip
        limits = tuple(klass.output.sample(rng, 1 << 20) for _ in range(count))
        out.append(Conversation(len(out), now, system, users, limits))
        left -= count
    return out
