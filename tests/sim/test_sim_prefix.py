"""The simulator's prefix caches: conversations name their blocks as the live system hashes them, regions keep
what they prefilled and decoded (LRU, a chain's tail first), and the scheduler places on that residency, so a
conversation's later turns compute only what is new; without caches (`prefix_aware=False`) every token is."""

from __future__ import annotations

from prfaas.control_plane.scheduling import Slo
from prfaas.sim.fleet import FleetSpec, LinkSpec, RegionSpec
from prfaas.sim.policies import prefix_blind_policy, prfaas_policy
from prfaas.sim.prefix import PrefixModel
from prfaas.sim.simulator import Outcome, Simulation
from prfaas.sim.workload import LengthDist, MultiTurn


def test_a_conversation_s_turns_extend_one_chain_and_share_the_system_prompt() -> None:
    workload = MultiTurn(turns=3, system_tokens=256, user=LengthDist(100, 0.0), output=LengthDist(40, 0.0),
                         think_s=1.0, block_tokens=64)  # fmt: skip
    arrivals = workload.generate(1.0, 6, seed=1)
    first = [a for a in arrivals if a.prefix and a.prefix[-1].startswith("c0.")]
    assert [a.prompt_tokens for a in first] == [356, 496, 636]  # 256 + 100, + 40 + 100, ...
    assert [len(a.prefix) for a in first] == [5, 7, 9]  # full 64-token blocks
    assert first[1].prefix[: len(first[0].prefix)] == first[0].prefix  # turn 2 re-sends turn 1
    assert first[0].kept == first[1].prefix[: len(first[0].kept)]  # what a decode keeps is the next turn's head
    other = next(a for a in arrivals if a.prefix[-1].startswith("c1."))
    assert other.prefix[:4] == first[0].prefix[:4] == ("s0", "s1", "s2", "s3")  # the shared system prompt


def test_the_model_evicts_a_chain_s_tail_before_its_head() -> None:
    cache = PrefixModel(capacity_blocks=4)
    cache.keep(("a0", "a1", "a2"))
    cache.keep(("b0", "b1"))  # 5 blocks: one must go, the tail of the older chain
    assert cache.held(("a0", "a1", "a2")) == 2 and cache.held(("b0", "b1")) == 2
    assert cache.resident == {"a0", "a1", "b0", "b1"}


def _run(prefix_aware: bool) -> list[int]:
    pd = RegionSpec("pd", "H100", num_prefill_workers=1, num_decode_workers=2, gpus_per_worker=1,
                    prefix_cache_blocks=10_000)  # fmt: skip
    cheap = RegionSpec("cheap", "L40S", num_prefill_workers=2, gpus_per_worker=1, prefix_cache_blocks=10_000)
    fleet = FleetSpec(model="dense-8b", regions=(cheap, pd), links=(LinkSpec("cheap", "pd", 25.0, 20.0),))
    policy = prfaas_policy() if prefix_aware else prefix_blind_policy()
    sim = Simulation(fleet, policy.scheduler(), Slo(ttft_ms=60_000, tpot_ms=1_000), prefix_aware=prefix_aware)
    arrivals = MultiTurn(turns=4, think_s=20.0).generate(0.5, 40, seed=3)
    records = sim.run(arrivals)
    assert all(r.outcome is Outcome.COMPLETED for r in records)
    return [r.computed_tokens for r in records]


def test_hit_aware_placement_computes_only_what_is_new() -> None:
    aware, blind = _run(True), _run(False)
    assert sum(blind) == sum(a.prompt_tokens for a in MultiTurn(turns=4, think_s=20.0).generate(0.5, 40, seed=3))
    assert sum(aware) < 0.3 * sum(blind)  # a 4,096-token system prompt and each turn's history served from cache
