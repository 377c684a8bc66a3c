"""Prefill and decode agents in this process on tiny-llama, over real gRPC and a real KV
socket on loopback: the split path gives the colocated tokens, layer by layer."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch
from fake_device import FakeDevice
from region_kit import Region, events_kinds, generate_tokens, local_region, split_generate, wait_until

from prfaas.decode_region.hf_backend import HFDecode
from prfaas.engine.hf import HFEngine
from prfaas.engine.sampling import SamplingParams
from prfaas.engine.staging import MIN_BUFFER_BYTES, HostPool, LayerCopier
from prfaas.engine.upload import LayerUploader
from prfaas.prefill_region.hf_backend import HFPrefill

GREEDY = SamplingParams(max_new_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def region(tiny_engine: HFEngine) -> Iterator[Region]:
    region = local_region(tiny_engine, metrics=True)
    yield region
    region.close()


@pytest.mark.parametrize("codec", ["raw", "lossless"])
def test_split_tokens_equal_colocated_generate(
    region: Region, tiny_engine: HFEngine, long_text: str, codec: str
) -> None:
    ids = tiny_engine.encode(long_text)[:300]
    kv_bytes = len(ids) * tiny_engine.kv_bytes_per_token

    run = split_generate(region.prefill_stub, region.decode_stub, ids, GREEDY, kv_bytes, codec=codec)

    assert run.tokens == tiny_engine.generate(ids, GREEDY)
    assert [e.index for e in run.token_events] == list(range(GREEDY.max_new_tokens))
    assert run.token_events[-1].last and run.token_events[-1].finish_reason == "length"
    kinds = list(events_kinds(run.events))
    num_layers = tiny_engine.num_layers
    # layer-wise: every layer is handed to the transport before prefill is done
    assert kinds == ["started"] + ["layer_shipped"] * num_layers + ["prefill_done", "shipment_complete"]
    complete = run.events[-1].shipment_complete
    assert complete.raw_bytes == kv_bytes
    assert region.decode is not None and region.decode.book.used_bytes == 0  # freed after the decode


def test_a_kvw6_split_decodes_from_the_keys_the_models_query_energy_shaped(
    region: Region, tiny_engine: HFEngine, long_text: str
) -> None:
    """A calibrated prefill region (make models calibrates tiny-llama) ships kvw6 with its engine's query
    energy: the decode region's tokens are those decoded here from the same KV through kvw6 with those
    weights, and the wire carries what kvw6 promises."""
    from prfaas.engine.kv import KVCache, LayerKV
    from prfaas.transport.codecs import TensorMeta, get_codec

    energy = tiny_engine.query_energy
    assert energy is not None, "tiny-llama is not calibrated: run `make models`"
    ids = tiny_engine.encode(long_text)[:300]
    kv_bytes = len(ids) * tiny_engine.kv_bytes_per_token
    run = split_generate(region.prefill_stub, region.decode_stub, ids, GREEDY, kv_bytes, codec="kvw6")

    exact = tiny_engine.prefill(ids, GREEDY)
    codec = get_codec("kvw6")

    def through(t: torch.Tensor, layer: int, part: int) -> torch.Tensor:
        meta = TensorMeta(exact.kv.dtype, tuple(t.shape), part, energy[layer] if part == 0 else None)
        data = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        return torch.frombuffer(bytearray(codec.decode(codec.encode(data, meta), meta)), dtype=t.dtype).view(t.shape)

    layers = tuple(LayerKV(through(x.k, i, 0), through(x.v, i, 1)) for i, x in enumerate(exact.kv.layers))
    lossy = KVCache(exact.kv.model_fingerprint, exact.kv.dtype, layers, exact.kv.num_tokens, exact.kv.token_ids_hash)
    assert run.tokens == [exact.first_token, *tiny_engine.decode(lossy, exact.first_token, GREEDY, ids)]
    complete = run.events[-1].shipment_complete
    assert complete.raw_bytes == kv_bytes and complete.raw_bytes / complete.wire_bytes > 2.2


def test_split_through_both_gpu_staging_paths_on_a_fake_device(tiny_engine: HFEngine, long_text: str) -> None:
    """The path a GPU region takes, through real gRPC and KV sockets, with a fake device's copy engine: each
    layer staged out of "device memory" as the forward writes it, shipped, and uploaded into "device memory"
    as it lands; the tokens are the colocated ones and every pinned buffer goes back to its pool."""
    region = local_region(tiny_engine)
    device = FakeDevice(delay_s=0.001)
    out, into = HostPool(64 << 20, pinned=False), HostPool(64 << 20, pinned=False)
    try:
        assert region.prefill is not None and region.decode is not None
        prefill, decode = region.prefill.backend, region.decode.backend
        assert isinstance(prefill, HFPrefill) and isinstance(decode, HFDecode)
        assert prefill.copier is None and decode.uploader is None  # on the CPU: neither path
        assert region.registration is not None and region.registration.kv_dtype == tiny_engine.facts.dtype
        prefill.copier = LayerCopier(device, out)
        decode.uploader = LayerUploader(device, into, torch.device("cpu"))
        ids = tiny_engine.encode(long_text)[:300]
        kv_bytes = len(ids) * tiny_engine.kv_bytes_per_token
        run = split_generate(region.prefill_stub, region.decode_stub, ids, GREEDY, kv_bytes)
        assert run.tokens == tiny_engine.generate(ids, GREEDY)
        layers = tiny_engine.num_layers
        assert device.copies == layers + 2 * layers  # out: K and V of a layer in one copy; in: each part
        assert into.acquires == 2 * layers and into.in_use_bytes == 0
        wait_until(lambda: out.in_use_bytes == 0, 5)  # given back once the transfer ended
        assert out.acquires == 2 * layers
    finally:
        region.close()


def test_a_layer_larger_than_the_upload_pool_fails_the_shipment_with_the_reason(
    tiny_engine: HFEngine, long_text: str
) -> None:
    region = local_region(tiny_engine)
    try:
        assert region.decode is not None and isinstance(region.decode.backend, HFDecode)
        pool = HostPool(MIN_BUFFER_BYTES, pinned=False)  # staging_bytes below one layer part
        region.decode.backend.uploader = LayerUploader(FakeDevice(), pool, torch.device("cpu"))
        ids = tiny_engine.encode(long_text)[:600]
        kv_bytes = len(ids) * tiny_engine.kv_bytes_per_token
        assert kv_bytes // tiny_engine.num_layers // 2 > MIN_BUFFER_BYTES
        with pytest.raises(grpc.RpcError) as info:
            split_generate(region.prefill_stub, region.decode_stub, ids, GREEDY, kv_bytes)
        # the prefill's stream ends with the decode region's cancel, saying why; or, when its last layer was
        # sent before the decode region read the first (the cancel then comes too late), the Decode call does
        assert info.value.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.FAILED_PRECONDITION), info.value
        assert "KV upload to the device" in info.value.details() and "does not fit" in info.value.details()
        assert pool.in_use_bytes == 0
    finally:
        region.close()


def test_generate_local_path_equals_engine(region: Region, tiny_engine: HFEngine, long_text: str) -> None:
    ids = tiny_engine.encode(long_text)[:50]
    assert generate_tokens(region.decode_stub, ids, GREEDY) == tiny_engine.generate(ids, GREEDY)


def test_whole_cache_variant_gives_same_tokens(region: Region, tiny_engine: HFEngine, long_text: str) -> None:
    ids = tiny_engine.encode(long_text)[:200]
    run = split_generate(
        region.prefill_stub, region.decode_stub, ids, GREEDY, len(ids) * tiny_engine.kv_bytes_per_token, whole=True
    )
    assert run.tokens == tiny_engine.generate(ids, GREEDY)
    kinds = list(events_kinds(run.events))
    assert kinds.count("layer_shipped") == tiny_engine.num_layers


@pytest.mark.parametrize("workers", [1, 2])
def test_concurrent_requests_share_the_configured_engine_workers(tiny_engine: HFEngine, workers: int) -> None:
    region = local_region(tiny_engine, prefill=False, workers=workers)
    params = SamplingParams(max_new_tokens=400, ignore_eos=True)
    assert region.decode is not None
    decode = region.decode
    peak = {"busy_workers": 0.0, "queue_depth": 0.0}
    try:
        with ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(generate_tokens, region.decode_stub, [1, 2, 3 + i], params) for i in range(2)]
            while not all(f.done() for f in futures):
                load = decode.load()
                for key in peak:
                    peak[key] = max(peak[key], load[key])
                time.sleep(0.002)
            outputs = [f.result() for f in futures]
        assert outputs == [tiny_engine.generate([1, 2, 3 + i], params) for i in range(2)]
        assert peak["busy_workers"] == workers  # never more than configured
        if workers == 1:
            assert peak["queue_depth"] == 1  # the second request waited for the worker
    finally:
        region.close()
