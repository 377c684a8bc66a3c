"""`--mix multiturn` plans: with `--rate R` and `--turns T`, conversations start at R / T per second, so about R
requests/s are offered (docs/operations.md); before, they started at R per second (T times the load asked)."""

from __future__ import annotations

import itertools
import statistics

import pytest

from prfaas.loadgen.conversations import plan_conversations
from prfaas.loadgen.workload import WorkloadError, WorkloadSpec

CORPUS = list(range(1000, 6000))


def test_rate_counts_requests_so_conversations_start_at_rate_over_turns() -> None:
    # 4,000 turns in 1,000 conversations of 4 at 2 req/s: a conversation every 4 / 2 = 2 s on average (the mean
    # of 999 exponential gaps: within 3 % of it, one standard deviation; seeded, so always the same draw)
    convs = plan_conversations(WorkloadSpec(4000, 2.0, mix="multiturn", seed=3), CORPUS, 2048, turns=4)
    assert len(convs) == 1000
    gaps = [b.start_s - a.start_s for a, b in itertools.pairwise(convs)]
    assert statistics.mean(gaps) == pytest.approx(2.0, rel=0.1)
    assert 4000 / convs[-1].start_s == pytest.approx(2.0, rel=0.1)  # requests offered per second


def test_one_turn_conversations_arrive_at_the_rate() -> None:
    convs = plan_conversations(WorkloadSpec(1000, 5.0, mix="multiturn", seed=4), CORPUS, 2048, turns=1)
    gaps = [b.start_s - a.start_s for a, b in itertools.pairwise(convs)]
    assert statistics.mean(gaps) == pytest.approx(0.2, rel=0.1)


def test_conversations_starting_past_the_cap_are_refused() -> None:
    # 40 turns of 4 at 0.1 req/s: a conversation every 40 s, the 10th near 400 s
    with pytest.raises(WorkloadError, match=r"--max-duration-s: .* past 60 s"):
        plan_conversations(WorkloadSpec(40, 0.1, mix="multiturn", max_duration_s=60.0), CORPUS, 2048, turns=4)
