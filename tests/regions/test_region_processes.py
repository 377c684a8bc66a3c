"""Two real region processes on loopback (`prfaas region --config`), SmolLM2 fp32: a
2,048-token prompt prefilled in one, its KV shipped layer by layer to the other, decoded
there; then the prefill region is killed with SIGKILL mid-shipment. A gRPC port in use is one error line."""

from __future__ import annotations

import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from region_kit import (
    RegionProcess,
    decode_request,
    generate_tokens,
    metric,
    new_job,
    prefill_request,
    reserve,
    spawn_region,
    split_generate,
    wait_until,
    write_config,
)

from prfaas.devstack.processes import region_argv
from prfaas.engine.models import model_fingerprint, prepare_model, resolve_model
from prfaas.engine.sampling import SamplingParams
from prfaas.protos.prfaas.v1 import common_pb2, decode_pb2_grpc, prefill_pb2_grpc

pytestmark = pytest.mark.e2e
MODEL = "smollm2-135m"
HEARTBEAT_S = 1.0
GREEDY = SamplingParams(max_new_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def regions(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RegionProcess, RegionProcess]]:
    prepare_model(MODEL)
    folder: Path = tmp_path_factory.mktemp("regions")
    common = {"model": MODEL, "heartbeat_interval_s": HEARTBEAT_S, "codec": "raw"}
    configs = [
        write_config(folder, name="prefill-a", role="prefill", **common),
        write_config(folder, name="decode-b", role="decode", kv_buffer_bytes="1GiB", **common),
    ]
    with ThreadPoolExecutor(2) as pool:
        prefill, decode = pool.map(spawn_region, configs)
    yield prefill, decode
    for region in (prefill, decode):
        region.stop()


@pytest.fixture(scope="module")
def prompt(long_text: str) -> list[int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(MODEL), local_files_only=True)
    ids = list(tokenizer(long_text, add_special_tokens=False)["input_ids"])[:2048]
    assert len(ids) == 2048
    return ids


Stubs = tuple[prefill_pb2_grpc.PrefillRegionStub, decode_pb2_grpc.DecodeRegionStub]


def _stubs(prefill: RegionProcess, decode: RegionProcess) -> Stubs:
    return (
        prefill_pb2_grpc.PrefillRegionStub(grpc.insecure_channel(prefill.grpc)),
        decode_pb2_grpc.DecodeRegionStub(grpc.insecure_channel(decode.grpc)),
    )


def _kv_bytes(num_tokens: int) -> int:
    return num_tokens * 2 * 30 * 3 * 64 * 4  # SmolLM2-135M fp32: 30 layers, 3 KV heads of 64


def test_split_across_region_processes_equals_colocated(
    regions: tuple[RegionProcess, RegionProcess], prompt: list[int]
) -> None:
    prefill, decode = regions
    prefill_stub, decode_stub = _stubs(prefill, decode)

    run = split_generate(prefill_stub, decode_stub, prompt, GREEDY, _kv_bytes(len(prompt)), prefill_grpc=prefill.grpc)
    colocated = generate_tokens(decode_stub, prompt, GREEDY)  # prefill and decode in one process

    assert run.tokens == colocated
    assert len(run.tokens) == GREEDY.max_new_tokens
    done = next(e.prefill_done for e in run.events if e.HasField("prefill_done"))
    assert done.kv.num_tokens == 2048
    complete = run.events[-1].shipment_complete
    assert complete.raw_bytes == _kv_bytes(2048)
    assert metric(decode.metrics, "prfaas_decode_kv_used_bytes") == 0


def test_kill_prefill_region_mid_shipment_frees_the_reservation(
    regions: tuple[RegionProcess, RegionProcess], prompt: list[int]
) -> None:
    prefill, decode = regions
    prefill_stub, decode_stub = _stubs(prefill, decode)
    job_id = new_job()
    kv_bytes = _kv_bytes(len(prompt))
    reply = reserve(decode_stub, job_id, kv_bytes, ttl_s=120, prefill_grpc=prefill.grpc)
    assert metric(decode.metrics, "prfaas_decode_kv_used_bytes") == kv_bytes
    stream = prefill_stub.Prefill(
        prefill_request(job_id, prompt, GREEDY, reply.kv_endpoint, budget=kv_bytes), timeout=60
    )
    shipped = 0
    for event in stream:
        if event.HasField("layer_shipped"):
            shipped += 1
        if shipped == 5:  # mid-shipment: 5 of 30 layers handed to the transport
            break

    prefill.proc.send_signal(signal.SIGKILL)
    killed = time.monotonic()

    with pytest.raises(grpc.RpcError) as info:
        list(stream)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    freed_s = wait_until(lambda: metric(decode.metrics, "prfaas_decode_kv_used_bytes") == 0, 2 * HEARTBEAT_S)
    kv = common_pb2.KVDescriptor(model_fingerprint=_fingerprint(), dtype="float32", num_tokens=2048)
    request = decode_request(job_id, GREEDY, kv=kv, timeout_s=10)
    with pytest.raises(grpc.RpcError) as info:
        list(decode_stub.Decode(request, timeout=10))
    assert info.value.code() == grpc.StatusCode.ABORTED  # the prefill region lost, not this one: PrefillLost
    assert "prefill region" in info.value.details()
    assert time.monotonic() - killed < 2 * HEARTBEAT_S
    print(f"reservation freed {freed_s:.3f} s after SIGKILL")
    assert prefill.proc.wait(5) == -signal.SIGKILL


def _fingerprint() -> str:
    return model_fingerprint(resolve_model(MODEL))


def test_a_grpc_port_in_use_is_one_error_line_and_exit_2(tmp_path: Path) -> None:
    """grpcio raises RuntimeError for it (a traceback); the region says which address, as for its KV port."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        address = f"127.0.0.1:{busy.getsockname()[1]}"
        config = write_config(tmp_path, name="decode-x", role="decode", listen={"grpc": address, "kv": "127.0.0.1:0"})
        done = subprocess.run(region_argv(config), capture_output=True, text=True, timeout=120, check=False)
    output = done.stdout + done.stderr
    assert done.returncode == 2 and f"cannot listen for gRPC on {address}" in output, output
    assert "Traceback" not in output
