"""Which transport a split takes between real region processes (`prfaas region`, tiny-llama):
a decode region on the same host and network namespace is reached through shared memory
without anyone asking (its kv_endpoint offers it, the prefill region picks it); one that
turns `shm` off is reached over TCP. Both give the colocated tokens."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from region_kit import RegionProcess, generate_tokens, spawn_region, split_generate, write_config

from prfaas.engine.hf import HFEngine
from prfaas.engine.models import prepare_model
from prfaas.engine.sampling import SamplingParams
from prfaas.protos.prfaas.v1 import decode_pb2_grpc, prefill_pb2_grpc

pytestmark = pytest.mark.e2e
GREEDY = SamplingParams(max_new_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def regions(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, RegionProcess]]:
    prepare_model("tiny-llama")
    folder: Path = tmp_path_factory.mktemp("transports")
    configs = {
        "prefill": write_config(folder, name="prefill-t", role="prefill"),
        "decode-shm": write_config(folder, name="decode-shm", role="decode", shm=True, shm_arena_bytes="64MiB"),
        "decode-tcp": write_config(folder, name="decode-tcp", role="decode", shm=False),
    }
    with ThreadPoolExecutor(3) as pool:
        started = dict(zip(configs, pool.map(spawn_region, configs.values()), strict=True))
    yield started
    with ThreadPoolExecutor(3) as pool:  # each stop waits for its process: in parallel
        list(pool.map(RegionProcess.stop, started.values()))


def _transfers(metrics_address: str) -> dict[str, float]:
    """prfaas_kv_transfers_total{status="completed"} by peer label."""
    with urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=5) as response:
        lines = response.read().decode().splitlines()
    out = {}
    for line in lines:
        if line.startswith("prfaas_kv_transfers_total{") and 'status="completed"' in line:
            peer = line.split('peer="', 1)[1].split('"', 1)[0]
            out[peer] = float(line.rsplit(" ", 1)[1])
    return out


@pytest.mark.parametrize(("decode_name", "expected"), [("decode-shm", "shm:"), ("decode-tcp", "127.0.0.1:")])
def test_split_takes_shared_memory_on_one_host_and_tcp_otherwise(
    regions: dict[str, RegionProcess], long_text: str, decode_name: str, expected: str
) -> None:
    engine = HFEngine("tiny-llama")
    prompt = engine.encode(long_text)[:500]
    prefill, decode = regions["prefill"], regions[decode_name]
    assert ("shm://" in decode.kv) is (decode_name == "decode-shm"), decode.kv
    prefill_stub = prefill_pb2_grpc.PrefillRegionStub(grpc.insecure_channel(prefill.grpc))
    decode_stub = decode_pb2_grpc.DecodeRegionStub(grpc.insecure_channel(decode.grpc))
    before = _transfers(prefill.metrics)
    run = split_generate(prefill_stub, decode_stub, prompt, GREEDY, len(prompt) * engine.kv_bytes_per_token)
    assert run.tokens == generate_tokens(decode_stub, prompt, GREEDY)
    after = _transfers(prefill.metrics)
    used = [peer for peer, count in after.items() if count > before.get(peer, 0)]
    assert len(used) == 1 and used[0].startswith(expected), (before, after)
