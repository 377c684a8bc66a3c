"""The decode pool: one continuous batch per region, advanced per batch iteration analytically."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import simpy

from prfaas.sim.decode import DecodePool, DecodeResult
from prfaas.sim.scenarios import small


@dataclass(frozen=True)
class LinearStep:
    """A step of 10 ms per sequence in the batch plus `per_ctx_s` per context token (per worker)."""

    per_ctx_s: float = 1e-6
    max_batch: int | None = None

    def decode_step_s(self, batch: int, context_tokens: int) -> float:
        return 0.010 * batch + self.per_ctx_s * context_tokens


def _run(
    jobs: list[tuple[float, int, int]], num_workers: int = 1, per_ctx_s: float = 1e-6, max_batch: int | None = None
) -> tuple[list[DecodeResult], DecodePool]:
    env = simpy.Environment()
    pool = DecodePool(env, LinearStep(per_ctx_s, max_batch), num_workers)  # type: ignore[arg-type]
    out: list[DecodeResult | None] = [None] * len(jobs)

    def one(i: int, at: float, prompt: int, output: int):  # type: ignore[no-untyped-def]
        yield env.timeout(at)
        out[i] = yield pool.decode(prompt, output)

    for i, job in enumerate(jobs):
        env.process(one(i, *job))
    env.run()
    assert all(r is not None for r in out)
    return [r for r in out if r is not None], pool


@pytest.mark.parametrize(("prompt", "output"), [(1000, 100), (0, 10_000), (1000, 32_000)])
def test_a_lone_sequence_takes_one_step_per_token_with_its_context_growing(prompt: int, output: int) -> None:
    # token 0 is the prefill's, then output - 1 steps; step k holds prompt + k tokens: the sum over k < output - 1
    # of (0.010 + 1e-6 (prompt + k)). The pool counts steps continuously (k steps at their mean context), a hair
    # (1e-6 / 2 s a step) above the sum. The step time frozen at the join's context was 33 % short at (0, 10000)
    # and 59 % at (1000, 32000)
    [result], pool = _run([(0.0, prompt, output)])
    exact = sum(0.010 + 1e-6 * (prompt + k) for k in range(output - 1))
    assert result.first_token_s == 0.0
    assert result.finish_s == pytest.approx(exact, rel=1e-3)
    assert result.tpot_s == pytest.approx(exact / (output - 1), rel=1e-3)
    assert pool.num_sequences == 0 and pool.context_tokens == 0


def test_a_joiner_mid_decode_sees_the_context_the_first_has_grown() -> None:
    # A (prompt 0, 2001 tokens) alone for 1 s: 0.010 + 1e-6 k a step, k = 99.5 steps (0.010 k + 1e-6 k^2 / 2 = 1);
    # then B (prompt 0, 11 tokens) joins: batch 2, context 99.5 growing by 2 a step. B's 10 steps end at
    # 1 + sum over j < 10 of (0.020 + 1e-6 (99.5 + 2 j)) = 1.201085 s (1.201000 with A's step frozen at its join:
    # 100 steps in that second, then a context of 100 held through B's steps)
    results, _ = _run([(0.0, 0, 2001), (1.0, 0, 11)])
    steps_a = (-0.010 + math.sqrt(0.010**2 + 2 * 1e-6 * 1.0)) / 1e-6
    exact = 1.0 + sum(0.020 + 1e-6 * (steps_a + 2 * j) for j in range(10))
    assert results[1].finish_s == pytest.approx(exact, abs=2e-5)  # the pool rounds the context to whole tokens


def test_a_late_joiner_slows_the_sequence_already_decoding() -> None:
    alone, _ = _run([(0.0, 0, 100)], per_ctx_s=0.0)
    shared, _ = _run([(0.0, 0, 100), (0.2, 0, 100)], per_ctx_s=0.0)
    # alone: 99 steps of 10 ms = 0.99 s; with the joiner, steps cost 20 ms from t=0.2: 20 steps + 79 x 20 ms
    assert alone[0].finish_s == pytest.approx(0.99)
    assert shared[0].finish_s == pytest.approx(0.2 + 79 * 0.020, rel=1e-6)
    assert shared[0].tpot_s > alone[0].tpot_s


def test_sequences_spread_over_workers_do_not_slow_each_other() -> None:
    # two workers, two sequences: batch per worker is 1, so both run at the lone pace
    results, _ = _run([(0.0, 0, 50), (0.0, 0, 50)], num_workers=2, per_ctx_s=0.0)
    assert [r.finish_s for r in results] == pytest.approx([0.49, 0.49])


def test_a_full_batch_makes_the_next_sequence_wait_for_a_slot() -> None:
    # max 2 sequences per worker, 1 worker: the third and fourth wait until the first two finish (49 steps of
    # 20 ms: t=0.98), then join (their first token goes out then) and share the batch: the fourth's 9 steps of 20 ms
    results, pool = _run([(0.0, 0, 50), (0.0, 0, 50), (0.1, 0, 50), (0.2, 0, 10)], per_ctx_s=0.0, max_batch=2)
    assert [r.finish_s for r in results[:2]] == pytest.approx([0.98, 0.98])
    assert [r.first_token_s for r in results[2:]] == pytest.approx([0.98, 0.98])
    assert results[3].finish_s == pytest.approx(0.98 + 9 * 0.020)
    assert not pool.waiting and pool.num_sequences == 0


def test_without_a_cap_nothing_waits() -> None:
    results, pool = _run([(0.0, 0, 50)] * 3, per_ctx_s=0.0)
    assert [r.first_token_s for r in results] == [0.0, 0.0, 0.0] and not pool.waiting
    assert [r.finish_s for r in results] == pytest.approx([49 * 0.030] * 3)


def test_a_one_token_answer_is_the_prefills_and_takes_no_step() -> None:
    [result], pool = _run([(0.5, 100, 1)])
    assert (result.first_token_s, result.finish_s, result.tpot_s) == (0.5, 0.5, 0.0) and pool.num_sequences == 0


def test_a_pool_at_an_epoch_sized_clock_finishes() -> None:
    # at t = 1.7e9 (a trace in Unix seconds) a float step of the clock is 2.4e-7 s; the timer to the next finish
    # (5.8e-6 steps of 10.9 ms = 6.3e-8 s) fell under it, so env.now + delay == env.now, no step was counted, and
    # the pool re-armed the same timer forever
    scenario = small()
    env = simpy.Environment(initial_time=1.7e9)
    pool = DecodePool(env, scenario.fleet.worker(scenario.fleet.regions[1]), 2)
    out: list[DecodeResult] = []

    def one():  # type: ignore[no-untyped-def]
        yield env.timeout(0.123)
        out.append((yield pool.decode(2000, 300)))

    env.process(one())
    for _ in range(10_000):
        if env.peek() == math.inf:
            break
        env.step()
    else:
        pytest.fail(f"the pool is still waking at t = {env.now!r}")
    [result] = out
    assert result.finish_s - 1.7e9 == pytest.approx(0.123 + 299 * result.tpot_s, abs=1e-6)
    assert pool.num_sequences == 0
