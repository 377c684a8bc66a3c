"""Prefix caching: the block hash scheme, the LRU block cache, and the HF engine reusing a
cached prefix without changing a single output token (tiny-llama and SmolLM2, fp32)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from prfaas.engine.blocks import block_hashes, short
from prfaas.engine.errors import InvalidPrompt
from prfaas.engine.hf import HFEngine
from prfaas.engine.models import prepare_model
from prfaas.engine.prefix_cache import PrefixCache, ResidencyMirror
from prfaas.engine.sampling import SamplingParams

GREEDY = SamplingParams(max_new_tokens=24, ignore_eos=True)
SEEDED = SamplingParams(max_new_tokens=24, temperature=0.9, top_p=0.9, top_k=40, seed=7, ignore_eos=True)
BLOCK = 16


# -- block hashes -----------------------------------------------------------------------------


def test_same_tokens_same_hashes_and_partial_block_is_not_hashed() -> None:
    ids = list(range(100, 170))  # 4 full blocks of 16 and 6 tokens over
    assert block_hashes(ids, BLOCK) == block_hashes(list(ids), BLOCK)
    assert len(block_hashes(ids, BLOCK)) == 4
    assert block_hashes(ids, BLOCK) == block_hashes(ids[:64], BLOCK)  # the 6 tokens over change nothing
    assert len(block_hashes(ids, BLOCK, limit=2)) == 2


def test_a_changed_token_changes_its_block_and_every_later_one() -> None:
    ids = list(range(64))
    other = [*ids[:20], 999, *ids[21:]]  # token 20 is in block 1
    a, b = block_hashes(ids, BLOCK), block_hashes(other, BLOCK)
    assert a[0] == b[0]
    assert all(x != y for x, y in zip(a[1:], b[1:], strict=True))  # chained: block 2 names its whole prefix


def test_salt_scopes_the_hashes() -> None:
    ids = list(range(32))
    assert block_hashes(ids, BLOCK, "t-1")[0] != block_hashes(ids, BLOCK, "t-2")[0]
    assert len(short(block_hashes(ids, BLOCK)[0])) == 16


def test_a_token_id_past_int32_is_an_invalid_prompt_and_valid_ids_keep_their_hashes() -> None:
    # decode.proto carries token ids as uint32: 2^31 .. 2^32 - 1 reach the hash, which reads int32
    for bad in (1 << 31, (1 << 32) - 1):
        with pytest.raises(InvalidPrompt, match=str(bad)):
            block_hashes([*range(15), bad], BLOCK, "t")
    # pinned: regions and the API compare these digests across processes and releases
    assert block_hashes([*range(15), (1 << 31) - 1], BLOCK, "t")[0].hex() == "27af92546b730bd487633750169077aa"


# -- the cache --------------------------------------------------------------------------------


def _layers(num_tokens: int, num_layers: int = 2, fill: float = 0.0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """KV of `num_tokens` tokens: [kv_heads=2, tokens, head_dim=4] per layer, each token's value its index."""
    base = torch.arange(num_tokens, dtype=torch.float32).view(1, -1, 1).expand(2, num_tokens, 4) + fill
    return [(base.clone(), -base.clone()) for _ in range(num_layers)]


BLOCK_BYTES = 2 * 2 * 2 * BLOCK * 4 * 4  # layers x (k, v) x heads x tokens x head_dim x float32


def test_lookup_returns_the_longest_cached_run_of_leading_blocks() -> None:
    cache = PrefixCache(BLOCK, max_bytes=1 << 20)
    digests = block_hashes(list(range(64)), BLOCK)
    assert cache.insert(digests[:3], _layers(48)) == 3
    hit = cache.lookup(digests)
    assert hit is not None and hit.num_blocks == 3 and hit.num_tokens == 48
    k, v = hit.layers[1]
    assert k.shape == (2, 48, 4) and torch.equal(k[0, :, 0], torch.arange(48, dtype=torch.float32))
    assert torch.equal(v, -k)
    assert cache.lookup(block_hashes(list(range(1, 65)), BLOCK)) is None  # another prompt from its first token


def test_bytes_bound_evicts_a_chains_tail_first() -> None:
    cache = PrefixCache(BLOCK, max_bytes=4 * BLOCK_BYTES)
    first = block_hashes(list(range(64)), BLOCK)  # 4 blocks: fills the cache
    cache.insert(first, _layers(64))
    assert cache.nbytes == 4 * BLOCK_BYTES and len(cache) == 4
    second = block_hashes(list(range(1000, 1032)), BLOCK)  # 2 more: two of the first chain must go
    cache.insert(second, _layers(32, fill=1000))
    assert cache.nbytes <= cache.max_bytes
    hit = cache.lookup(first)
    assert hit is not None and hit.num_blocks == 2  # its head survived; the tail went first
    assert cache.lookup(second) is not None


def test_a_head_evicted_while_its_chain_is_inserted_leaves_no_unreachable_tail() -> None:
    """Chain [a, b] inserted while a is held, and another insert evicts a before b lands: b is not added
    (before, it was: unreachable, since lookups stop at the first miss, yet kept and published)."""
    cache = PrefixCache(BLOCK, max_bytes=2 * BLOCK_BYTES)
    chain = block_hashes(list(range(32)), BLOCK)
    cache.insert(chain[:1], _layers(16))  # a is held
    other = block_hashes(list(range(1000, 1032)), BLOCK)

    class Racing(list[tuple[torch.Tensor, torch.Tensor]]):
        raced = False

        def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:  # read while b's block is built
            if not self.raced:
                self.raced = True
                cache.insert(other, _layers(32, fill=1000))  # fills the cache: a (least recent) goes
            return super().__iter__()

    cache.insert(chain, Racing(_layers(32)))
    assert not {short(d) for d in chain} & set(cache.resident())  # neither held nor published
    assert cache.lookup(other) is not None


def test_resident_lists_chain_heads_first_and_version_moves_on_change() -> None:
    cache = PrefixCache(BLOCK, max_bytes=1 << 20, publish_limit=3)
    digests = block_hashes(list(range(64)), BLOCK)
    before = cache.version
    cache.insert(digests, _layers(64))
    assert cache.version > before
    assert cache.resident() == [short(d) for d in digests[:3]]  # the most recently used: the head, then on
    after = cache.version
    cache.insert(digests, _layers(64))  # nothing new
    assert cache.version == after


def test_a_zero_byte_cache_keeps_nothing() -> None:
    cache = PrefixCache(BLOCK, max_bytes=0)
    assert cache.insert(block_hashes(list(range(32)), BLOCK), _layers(32)) == 0
    assert len(cache) == 0


# -- the engine: a hit never changes the output ---------------------------------------------


@pytest.fixture(scope="module")
def smollm2() -> HFEngine:
    prepare_model("smollm2-135m")
    return HFEngine("smollm2-135m")


@pytest.fixture(params=["tiny", "smollm2"])
def engine(request: pytest.FixtureRequest, tiny_engine: HFEngine, smollm2: HFEngine) -> Iterator[HFEngine]:
    chosen = tiny_engine if request.param == "tiny" else smollm2
    chosen.prefix_cache = PrefixCache(BLOCK, max_bytes=256 << 20)
    yield chosen
    chosen.prefix_cache = None


def _generate(engine: HFEngine, ids: list[int], params: SamplingParams, salt: str | None) -> tuple[list[int], int]:
    result = engine.prefill(ids, params, cache_salt=salt)
    tokens = [result.first_token, *engine.decode(result.kv, result.first_token, params, ids, salt)]
    return tokens, result.cached_tokens


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_cached_prefix_gives_the_tokens_of_a_cold_run(
    engine: HFEngine, long_text: str, params: SamplingParams
) -> None:
    ids = engine.encode(long_text)
    for start, prefix, total in ((0, 200, 330), (5000, 96, 301), (9000, 250, 251)):
        first, longer = ids[start : start + prefix], ids[start : start + total]
        _generate(engine, first, params, "t")  # leaves the first prompt's blocks behind
        cold, _ = _generate(engine, longer, params, None)
        warm, cached = _generate(engine, longer, params, "t")
        assert cached == (min(prefix, total - 1) // BLOCK) * BLOCK > 0
        assert warm == cold


def test_decode_leaves_prompt_and_output_blocks_for_the_next_turn(engine: HFEngine, long_text: str) -> None:
    ids = engine.encode(long_text)[12000:12100]
    turn1, _ = _generate(engine, ids, GREEDY, "t")
    follow_up = engine.encode(long_text)[13000:13040]
    turn2 = [*ids, *turn1, *follow_up]
    cold, _ = _generate(engine, turn2, GREEDY, None)
    warm, cached = _generate(engine, turn2, GREEDY, "t")
    assert cached == ((len(ids) + len(turn1) - 1) // BLOCK) * BLOCK  # the prompt and the reply, but the last token
    assert warm == cold


def test_another_salt_or_no_salt_reuses_nothing(engine: HFEngine, long_text: str) -> None:
    ids = engine.encode(long_text)[14000:14100]
    engine.prefill(ids, GREEDY, cache_salt="tenant-a")
    assert engine.prefill(ids, GREEDY, cache_salt="tenant-b").cached_tokens == 0
    assert engine.prefill(ids, GREEDY).cached_tokens == 0
    assert engine.prefill(ids, GREEDY, cache_salt="tenant-a").cached_tokens == 96


def test_prompt_logprobs_compute_the_prompt_whole(engine: HFEngine, long_text: str) -> None:
    ids = engine.encode(long_text)[15000:15100]
    engine.prefill(ids, GREEDY, cache_salt="t")
    with_logprobs = SamplingParams(max_new_tokens=4, prompt_logprobs=2)
    result = engine.prefill(ids, with_logprobs, cache_salt="t")
    assert result.cached_tokens == 0 and len(result.first.prompt) == len(ids) - 1


def test_a_residency_mirror_publishes_chains_heads_first_within_its_capacity() -> None:
    mirror = ResidencyMirror(BLOCK, capacity_blocks=3)
    first = block_hashes(list(range(48)), BLOCK, "t")
    mirror.keep(first)
    before = mirror.version
    second = block_hashes(list(range(100, 132)), BLOCK, "t")  # 2 more: the first chain's tail goes
    mirror.keep(second)
    assert mirror.version > before
    assert mirror.resident() == [short(second[0]), short(second[1]), short(first[0])]


@pytest.fixture
def cached_tiny(tiny_engine: HFEngine) -> Iterator[HFEngine]:
    tiny_engine.prefix_cache = PrefixCache(BLOCK, max_bytes=256 << 20)
    yield tiny_engine
    tiny_engine.prefix_cache = None


def test_decode_keeps_no_kv_under_a_prompt_it_was_not_computed_from(cached_tiny: HFEngine, long_text: str) -> None:
    ids = cached_tiny.encode(long_text)
    a, b = ids[16000:16040], ids[17000:17040]
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    kv_a = cached_tiny.prefill(a, params).kv  # unsalted: nothing cached yet
    list(cached_tiny.decode(kv_a, 7, params, b, "t"))  # b's ids beside a's KV (its hash says a)
    assert cached_tiny.prefill(b, params, cache_salt="t").cached_tokens == 0
    assert len(cached_tiny.prefix_cache or ()) == 2  # b's own prefill, 2 full blocks: nothing of a's under b


def test_a_decode_forward_that_fails_raises_its_own_error_and_keeps_nothing(
    cached_tiny: HFEngine, long_text: str
) -> None:
    prompt = cached_tiny.encode(long_text)[18000 : 18000 + 2 * BLOCK - 1]  # the first fed token ends block 1
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    kv = cached_tiny.prefill(prompt, params).kv

    def device_lost(*_: object) -> None:
        raise RuntimeError("device lost")

    # the last layer fails: every other layer's cache holds one token more than it
    hook = cached_tiny.model.model.layers[-1].register_forward_pre_hook(device_lost)
    try:
        with pytest.raises(RuntimeError, match="device lost"):
            list(cached_tiny.decode(kv, 7, params, prompt, "t"))
    finally:
        hook.remove()
    assert len(cached_tiny.prefix_cache or ()) == 0
