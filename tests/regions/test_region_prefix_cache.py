"""Prefix caches in regions (tiny-llama, real gRPC and KV sockets on loopback): a decode region
that holds a prompt's prefix pins it at Reserve and receives only the suffix's KV; a prefill
region with a hit computes only the suffix; lossy KV never enters a cache; heartbeats publish
the resident blocks. Every output equals a cold run's."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
import torch
from fake_device import FakeDevice
from region_kit import Region, decode_request, local_region, new_job, prefill_request

from prfaas.decode_region.hf_backend import HFDecode
from prfaas.engine.blocks import block_hashes, short
from prfaas.engine.hf import HFEngine
from prfaas.engine.prefix_cache import PrefixCache
from prfaas.engine.sampling import SamplingParams
from prfaas.engine.staging import HostPool
from prfaas.engine.upload import LayerUploader
from prfaas.protos.prfaas.v1 import decode_pb2, prefill_pb2
from prfaas.region.requests import sampling_to_proto

GREEDY = SamplingParams(max_new_tokens=10, ignore_eos=True)
PENALIZED = SamplingParams(max_new_tokens=10, ignore_eos=True, repetition_penalty=1.2)
BLOCK = 16
SALT = "acme"


def _engine() -> HFEngine:
    return HFEngine("tiny-llama", prefix_cache=PrefixCache(BLOCK, 64 << 20))


@pytest.fixture(scope="module")
def regions() -> Iterator[tuple[Region, Region]]:
    """A prefill-only and a decode-only region, each with its own engine and prefix cache."""
    prefill = local_region(_engine(), decode=False, name="pre")
    decode = local_region(_engine(), prefill=False, name="dec")
    yield prefill, decode
    prefill.close()
    decode.close()


def _cache(region: Region) -> PrefixCache:
    agent = region.decode or region.prefill
    assert agent is not None
    cache = agent.backend.engine.prefix_cache  # type: ignore[attr-defined]
    assert isinstance(cache, PrefixCache)
    return cache


def _local(region: Region, ids: list[int]) -> tuple[list[int], int]:
    """A local run with the salt: its tokens and the prefix cache hit it reported."""
    request = decode_pb2.GenerateRequest(
        job_id=new_job(), token_ids=ids, sampling=sampling_to_proto(GREEDY), timeout_s=60, cache_salt=SALT
    )
    events = list(region.decode_stub.Generate(request, timeout=60))
    return [e.token for e in events], events[0].cached_tokens


def _split(
    prefill: Region, decode: Region, ids: list[int], engine: HFEngine, *, codec: str = "raw", pin: bool = True
) -> tuple[list[int], int, prefill_pb2.PrefillDone, prefill_pb2.ShipmentComplete]:
    """Reserve (pinning when `pin`), Prefill shipping what the decode region lacks, Decode: (tokens,
    tokens pinned, prefill done, shipment)."""
    job_id = new_job()
    kv_bytes = len(ids) * engine.kv_bytes_per_token
    reserve = decode_pb2.ReserveRequest(job_id=job_id, attempt=1, tenant="acme", kv_bytes=kv_bytes, ttl_s=60)
    if pin:
        reserve.cache_salt = SALT
        reserve.token_ids.extend(ids)
    reply = decode.decode_stub.Reserve(reserve, timeout=10)
    request = prefill_request(job_id, ids, GREEDY, reply.kv_endpoint, codec=codec, budget=kv_bytes)
    request.cache_salt = SALT
    request.ship_from_token = reply.cached_tokens
    events = list(prefill.prefill_stub.Prefill(request, timeout=60))
    done = next(e.prefill_done for e in events if e.HasField("prefill_done"))
    shipped = next(e.shipment_complete for e in events if e.HasField("shipment_complete"))
    call = decode_request(job_id, GREEDY, done)
    call.token_ids.extend(ids)
    call.cache_salt = SALT
    tokens = [e.token for e in decode.decode_stub.Decode(call, timeout=60)]
    return tokens, reply.cached_tokens, done, shipped


@pytest.mark.parametrize("upload", [False, True], ids=["host", "fake-gpu"])
def test_a_decode_region_holding_the_prefix_receives_only_the_suffix(
    regions: tuple[Region, Region], tiny_engine: HFEngine, long_text: str, upload: bool
) -> None:
    """`fake-gpu`: a decode region of its own whose shipments go through the device upload (a fake device's
    copy engine, tests/fake_device.py), the held prefix joined to them after the last copy landed."""
    prefill, decode = regions
    pool = HostPool(64 << 20, pinned=False)
    if upload:
        decode = local_region(_engine(), prefill=False, name="dec-gpu")
        assert decode.decode is not None and isinstance(decode.decode.backend, HFDecode)
        decode.decode.backend.uploader = LayerUploader(FakeDevice(), pool, torch.device("cpu"))
    try:
        _holding_the_prefix(prefill, decode, tiny_engine, long_text)
        assert pool.acquires == (2 * tiny_engine.num_layers if upload else 0) and pool.in_use_bytes == 0
    finally:
        if upload:
            decode.close()


def _holding_the_prefix(prefill: Region, decode: Region, tiny_engine: HFEngine, long_text: str) -> None:
    ids = tiny_engine.encode(long_text)[1000:1200]
    turn1, cached1 = _local(decode, ids)  # the decode region now holds the prompt's and the reply's blocks
    assert cached1 == 0
    turn2 = [*ids, *turn1, *tiny_engine.encode(long_text)[2000:2050]]

    tokens, pinned, done, shipped = _split(prefill, decode, turn2, tiny_engine)

    covered = len(ids) + len(turn1) - 1  # the reply's last token was never fed back
    assert pinned == (covered // BLOCK) * BLOCK > 0
    assert shipped.raw_bytes == (len(turn2) - pinned) * tiny_engine.kv_bytes_per_token  # only the suffix crossed
    assert done.kv.num_tokens == len(turn2)
    assert tokens == tiny_engine.generate(turn2, GREEDY)  # a cold run on the shared engine (no cache)


def test_a_prefill_region_with_a_hit_computes_only_the_suffix(
    regions: tuple[Region, Region], tiny_engine: HFEngine, long_text: str
) -> None:
    prefill, decode = regions
    first = tiny_engine.encode(long_text)[3000:3300]
    _split(prefill, decode, first, tiny_engine, pin=False)
    longer = [*first, *tiny_engine.encode(long_text)[4000:4100]]

    tokens, pinned, done, shipped = _split(prefill, decode, longer, tiny_engine, pin=False)

    assert pinned == 0 and shipped.raw_bytes == len(longer) * tiny_engine.kv_bytes_per_token  # all of it shipped
    assert done.cached_tokens == (len(first) // BLOCK) * BLOCK  # computed: the rest
    assert tokens == tiny_engine.generate(longer, GREEDY)


def test_kv_through_a_lossy_codec_never_enters_the_decode_cache(
    regions: tuple[Region, Region], tiny_engine: HFEngine, long_text: str
) -> None:
    prefill, decode = regions
    ids = tiny_engine.encode(long_text)[5000:5200]
    _split(prefill, decode, ids, tiny_engine, codec="int8", pin=False)
    digests = block_hashes(ids, BLOCK, SALT)
    assert _cache(decode).lookup(digests) is None
    assert _cache(prefill).lookup(digests) is not None  # the prefill region computed it losslessly itself


def test_a_decode_whose_prompt_is_not_its_kvs_is_refused_and_caches_nothing(
    regions: tuple[Region, Region], tiny_engine: HFEngine, long_text: str
) -> None:
    """A Decode that names another prompt (or ids outside the vocabulary) than the one its KV was computed
    from is INVALID_ARGUMENT before any token: it would have put this KV in the prefix cache under the other
    prompt's blocks, and a later job of that prompt and salt decoded from it (its output changed); out of
    the vocabulary with a repetition penalty, it was INTERNAL after token 0."""
    prefill, decode = regions
    ids, other = tiny_engine.encode(long_text)[6000:6064], tiny_engine.encode(long_text)[7000:7064]
    cold = tiny_engine.generate(other, GREEDY)  # the other prompt's output, from an engine that never saw the forgery
    for claimed, params in ((other, GREEDY), ([tiny_engine.vocab_size + 7] * len(ids), PENALIZED)):
        job_id = new_job()
        kv_bytes = len(ids) * tiny_engine.kv_bytes_per_token
        reply = decode.decode_stub.Reserve(decode_pb2.ReserveRequest(
            job_id=job_id, attempt=1, tenant="acme", kv_bytes=kv_bytes, ttl_s=60), timeout=10)  # fmt: skip
        events = list(prefill.prefill_stub.Prefill(
            prefill_request(job_id, ids, params, reply.kv_endpoint, budget=kv_bytes), timeout=60))  # fmt: skip
        call = decode_request(job_id, params, next(e.prefill_done for e in events if e.HasField("prefill_done")))
        call.token_ids.extend(claimed)
        call.cache_salt = SALT
        with pytest.raises(grpc.RpcError) as info:
            list(decode.decode_stub.Decode(call, timeout=60))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert _cache(decode).lookup(block_hashes(other, BLOCK, SALT)) is None
    assert _local(decode, other)[0] == cold


def test_heartbeats_publish_resident_blocks_when_they_change(
    regions: tuple[Region, Region], tiny_engine: HFEngine, long_text: str
) -> None:
    _, decode = regions
    ids = tiny_engine.encode(long_text)[6000:6100]
    decode.server.load()  # whatever was pending is sent
    _local(decode, ids)
    load = decode.server.load()
    assert load.prefix_included and load.prefix_version == _cache(decode).version
    assert short(block_hashes(ids, BLOCK, SALT)[0]) in set(load.prefix_blocks)
    again = decode.server.load()
    assert not again.prefix_included and not again.prefix_blocks  # unchanged: the registry keeps the last


def test_a_vllm_request_that_produced_no_token_publishes_no_resident_block() -> None:
    """The region mirrors vLLM's prefix cache from what it sent: a request the server refused, lost or timed
    out before any token computed nothing, and publishing its prompt would draw jobs to a cache it lacks."""
    from prfaas.decode_region.vllm_backend import _remembered  # the decode backend's wrapper of vLLM's tokens
    from prfaas.engine.prefix_cache import ResidencyMirror
    from prfaas.engine.sampling import Chosen

    def refused() -> Iterator[Chosen]:
        raise RuntimeError("ValueError: the server refused the request")
        yield  # a generator

    def one_token() -> Iterator[Chosen]:
        yield Chosen(7)

    mirror = ResidencyMirror(64, 10_000)
    prompt = list(range(1000, 1300))  # 4 whole blocks of 64
    with pytest.raises(RuntimeError):
        list(_remembered(refused(), mirror, prompt, "salt"))
    assert mirror.resident() == []
    assert [c.token for c in _remembered(one_token(), mirror, prompt, "salt")] == [7]
    assert len(mirror.resident()) == 4
