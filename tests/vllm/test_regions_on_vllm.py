"""Regions with `engine: vllm` as real `prfaas region` processes (prfaas's environment, each
starting its vLLM server with .venv-vllm's python), driven through the region gRPC surface
the way the control plane drives a split job (Reserve -> Prefill -> Decode), fp32 greedy
SmolLM2, a 512-token prompt, with mutual TLS on every link (gRPC and KV, the vLLM servers'
KV ports included) as in production:

- vLLM prefill region -> vLLM decode region: tokens equal the prompt run whole in one vLLM
  process (the decode region's own Generate);
- HF prefill region -> vLLM decode region (same wire format): the same tokens;
- vLLM prefill region -> HF decode region: the tokens of the HF region run colocated.

Three regions start once for the module (two vLLM servers start in parallel: 45-95 s). The
file name sorts first in tests/vllm, so these regions are gone before the session's vLLM
pair (conftest.py) starts: at most two vLLM servers (~2.5 GB each) at a time.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
from test_vllm_split import prompt_ids
from vllm_kit import MODEL, START_TIMEOUT_S

from prfaas.devstack.processes import LOOPBACK_REGION, RegionProcess, spawn_region, write_region_config
from prfaas.engine.kv import hash_token_ids
from prfaas.engine.models import model_fingerprint, prepare_model, resolve_model
from prfaas.engine.sampling import SamplingParams
from prfaas.protos.prfaas.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from prfaas.region.channels import TlsFiles, channel
from prfaas.region.requests import sampling_to_proto
from prfaas.transport.identity import Identity, server_name
from prfaas.transport.tickets import TicketSigner
from prfaas.transport.tls import init_certs

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]
# The regions run in prfaas's own environment (`make install`), not in this one.
REGION_PYTHON = os.environ.get("PRFAAS_REGION_PYTHON") or str(ROOT / ".venv" / "bin" / "python")
KEY = "vllm-region-tests-ticket-key-0123456789"
SIGNER = TicketSigner({"k1": KEY.encode()}, "k1")
GREEDY = SamplingParams(max_new_tokens=16, ignore_eos=True)
NUM_TOKENS = 512
KV_BYTES = NUM_TOKENS * 2 * 30 * 3 * 64 * 4  # SmolLM2-135M fp32: K,V x 30 layers x 3 KV heads x 64


# Every link mutual TLS, as in production: the regions' certificates and the one this module
# calls them with as the control plane (filled by the `regions` fixture).
TLS: dict[str, TlsFiles] = {}
IDENTITIES = {"cp": "prfaas://control-plane/tests", "vllm-p": "prfaas://prefill/vllm-p/1",
              "vllm-d": "prfaas://decode/vllm-d/1", "hf": "prfaas://both/hf/1"}  # fmt: skip


def _config(folder: Path, **fields: Any) -> Path:
    name = fields["name"]
    config = LOOPBACK_REGION | {"model": MODEL, "ticket_key": KEY, "instance": "1"} | fields
    return write_region_config(folder / f"{name}.yaml", config | {"tls": TLS[name].model_dump()})


def _issue_certificates(folder: Path) -> None:
    identities = {name: Identity.parse(uri) for name, uri in IDENTITIES.items()}
    init_certs(folder, list(identities), ["127.0.0.1"], identities=identities)
    for name in identities:
        TLS[name] = TlsFiles(ca=str(folder / "ca.pem"), cert=str(folder / f"{name}.pem"),
                             key=str(folder / f"{name}-key.pem"))  # fmt: skip


def _vllm(folder: Path, name: str) -> dict[str, Any]:
    bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    return {
        "python": sys.executable,
        "kv_cache_gib": 1,
        "cpu_threads_bind": bind,
        "enforce_eager": True,
        "start_timeout_s": START_TIMEOUT_S,
        "log": str(folder / f"{name}-vllm.log"),
    }


@pytest.fixture(scope="module")
def regions(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, RegionProcess]]:
    if not Path(REGION_PYTHON).is_file():
        pytest.fail(f"{REGION_PYTHON} is missing: the regions run in prfaas's environment (`make install`)")
    prepare_model(MODEL)
    folder = tmp_path_factory.mktemp("vllm-regions")
    _issue_certificates(folder / "pki")
    configs = {
        "vllm-p": _config(folder, name="vllm-p", role="prefill", engine="vllm", vllm=_vllm(folder, "vllm-p")),
        "vllm-d": _config(
            folder, name="vllm-d", role="decode", engine="vllm", kv_buffer_bytes="1GiB", vllm=_vllm(folder, "vllm-d")
        ),
        "hf": _config(folder, name="hf", role="both", kv_buffer_bytes="1GiB"),
    }
    env = {"PRFAAS_HOME": os.environ.get("PRFAAS_HOME", "")}
    env = {k: v for k, v in env.items() if v}

    def spawn(path: Path) -> RegionProcess:
        return spawn_region(path, timeout_s=START_TIMEOUT_S + 30, env=env, python=REGION_PYTHON)

    started = time.monotonic()
    with ThreadPoolExecutor(3) as pool:
        futures = {name: pool.submit(spawn, path) for name, path in configs.items()}
        procs: dict[str, RegionProcess] = {}
        try:
            for name, future in futures.items():
                procs[name] = future.result()
        except BaseException:
            for future in futures.values():
                if future.exception() is None:
                    future.result().stop()
            raise
    print(f"regions ready in {time.monotonic() - started:.1f} s")
    yield procs
    for proc in procs.values():
        proc.stop()


@pytest.fixture(scope="module")
def prompt(long_text: str) -> list[int]:
    return prompt_ids(long_text, NUM_TOKENS)


def _prefill(region: RegionProcess) -> prefill_pb2_grpc.PrefillRegionStub:
    return prefill_pb2_grpc.PrefillRegionStub(channel(region.grpc, TLS["cp"], server_name(region.name)))


def _decode(region: RegionProcess) -> decode_pb2_grpc.DecodeRegionStub:
    return decode_pb2_grpc.DecodeRegionStub(channel(region.grpc, TLS["cp"], server_name(region.name)))


def _split(prefill: RegionProcess, decode: RegionProcess, prompt: list[int], params: SamplingParams = GREEDY,
           salt: str | None = None, codec: str = "raw") -> tuple[list[Any], list[Any]]:  # fmt: skip
    """What the control plane does for a split job: Reserve, Prefill, Decode from PrefillDone (`salt`: the
    job's prefix cache scope; None: it uses no prefix cache; `codec`: the KV's on the wire).
    -> (the job's token events: step 0 from PrefillDone, then the decode's; the prefill's events)"""
    job = str(uuid.uuid4())
    reply = _decode(decode).Reserve(
        decode_pb2.ReserveRequest(
            job_id=job,
            attempt=1,
            tenant="acme",
            kv_bytes=KV_BYTES,
            ttl_s=120,
            prefill_grpc=prefill.grpc,
            prefill_region=prefill.name,
        ),
        timeout=30,
    )
    request = prefill_pb2.PrefillRequest(
        job_id=job,
        attempt=1,
        tenant="acme",
        token_ids=prompt,
        sampling=sampling_to_proto(params),
        timeout_s=120,
        destination=prefill_pb2.Destination(
            kv_endpoint=reply.kv_endpoint,
            codec=codec,
            ticket=SIGNER.issue(job, 1, "acme", KV_BYTES, ttl_s=120),  # for the bytes reserved
            decode_region=decode.name,  # the KV port's TLS server name
        ),
    )
    if salt is not None:
        request.cache_salt = salt
    events, tokens, errors = [], [], []
    decoder = None

    def run_decode(done: prefill_pb2.PrefillDone) -> None:
        call = decode_pb2.DecodeRequest(
            job_id=job,
            attempt=1,
            first_token=done.first_token,
            first_logprobs=done.first_logprobs if done.HasField("first_logprobs") else None,
            kv=done.kv,
            sampling=sampling_to_proto(params),
            timeout_s=120,
            token_ids=prompt,
        )
        if salt is not None:
            call.cache_salt = salt
        try:
            tokens.extend(_decode(decode).Decode(call, timeout=150))
        except grpc.RpcError as exc:
            errors.append(exc)

    for event in _prefill(prefill).Prefill(request, timeout=150):
        events.append(event)
        if event.HasField("prefill_done"):
            decoder = threading.Thread(target=run_decode, args=(event.prefill_done,))
            decoder.start()
    assert decoder is not None, events
    decoder.join(160)
    assert not errors, errors[0]
    return tokens, events


def _generate(region: RegionProcess, prompt: list[int], params: SamplingParams = GREEDY) -> list[Any]:
    """The prompt run whole in one region: its token events."""
    request = decode_pb2.GenerateRequest(
        job_id=str(uuid.uuid4()), token_ids=prompt, sampling=sampling_to_proto(params), timeout_s=120
    )
    return list(_decode(region).Generate(request, timeout=150))


def _ids(events: list[Any]) -> list[int]:
    return [event.token for event in events]


def _kv_used(region: RegionProcess) -> float:
    import urllib.request

    with urllib.request.urlopen(f"http://{region.metrics}/metrics", timeout=5) as response:
        for line in response.read().decode().splitlines():
            if line.startswith("prfaas_decode_kv_used_bytes "):
                return float(line.split()[1])
    raise AssertionError("no prfaas_decode_kv_used_bytes in /metrics")


def test_vllm_prefill_region_to_vllm_decode_region_equals_one_vllm_process(
    regions: dict[str, RegionProcess], prompt: list[int]
) -> None:
    reference = _ids(_generate(regions["vllm-d"], prompt))  # the prompt run whole in one vLLM process

    decoded, events = _split(regions["vllm-p"], regions["vllm-d"], prompt)
    tokens = _ids(decoded)

    assert tokens == reference
    assert len(tokens) == GREEDY.max_new_tokens
    done = next(e.prefill_done for e in events if e.HasField("prefill_done"))
    assert done.kv.num_tokens == NUM_TOKENS and done.kv.dtype == "float32"
    assert events[-1].HasField("shipment_complete") and events[-1].shipment_complete.raw_bytes == KV_BYTES
    assert _kv_used(regions["vllm-d"]) == 0  # the reservation ended with the decode


def test_a_vllm_prefill_region_computes_only_what_its_prefix_cache_lacks(
    regions: dict[str, RegionProcess], prompt: list[int]
) -> None:
    reference = _ids(_generate(regions["vllm-d"], prompt))  # no salt: nothing reused
    _split(regions["vllm-p"], regions["vllm-d"], prompt[:256], salt="acme")  # both servers now hold its blocks

    decoded, events = _split(regions["vllm-p"], regions["vllm-d"], prompt, salt="acme")

    done = next(e.prefill_done for e in events if e.HasField("prefill_done"))
    assert 128 <= done.cached_tokens <= 256, done  # vLLM's full blocks of the first 256 tokens
    assert _ids(decoded) == reference  # the same tokens, the decode region loading only past its own cached blocks
    assert events[-1].shipment_complete.raw_bytes == KV_BYTES  # a vLLM prefill region ships the whole prompt
    other, other_events = _split(regions["vllm-p"], regions["vllm-d"], prompt, salt="another-tenant")
    assert next(e.prefill_done for e in other_events if e.HasField("prefill_done")).cached_tokens == 0
    assert _ids(other) == reference


@pytest.mark.parametrize(
    ("prefill", "decode"),
    [
        pytest.param("hf", "vllm-d", id="hf-prefill-to-vllm-decode"),
        pytest.param("vllm-p", "hf", id="vllm-prefill-to-hf-decode"),
    ],
)
def test_a_split_across_engines_gives_the_decode_regions_own_tokens(
    regions: dict[str, RegionProcess], prompt: list[int], prefill: str, decode: str
) -> None:
    """An HF prefill region to a vLLM decode region and the reverse: the tokens the decode region gives the
    whole request by itself (Generate; on the HF region, prefill and decode in one process)."""
    reference = _ids(_generate(regions[decode], prompt))

    decoded, events = _split(regions[prefill], regions[decode], prompt)

    assert _ids(decoded) == reference
    assert events[-1].shipment_complete.raw_bytes == KV_BYTES


def test_a_calibrated_vllm_prefill_region_ships_kvw6_keys_by_the_models_query_energy(
    regions: dict[str, RegionProcess], prompt: list[int]
) -> None:
    """`make models` calibrates smollm2-135m and the region hands its vLLM engine the calibration, so kvw6's
    keys are quantized by query energy: 1.6% fewer bytes than kv6 on this model's fp32 KV (without the
    weights kvw6 ships kv6's key steps, within 0.05% of kv6's bytes; HF-side, 512-2,048 tokens), and the HF
    decode region continues from it."""
    _, six = _split(regions["vllm-p"], regions["hf"], prompt, codec="kv6")
    decoded, weighted = _split(regions["vllm-p"], regions["hf"], prompt, codec="kvw6")

    assert len(decoded) == GREEDY.max_new_tokens
    kv6, kvw6 = six[-1].shipment_complete, weighted[-1].shipment_complete
    assert kv6.raw_bytes == kvw6.raw_bytes == KV_BYTES
    assert kvw6.wire_bytes < 0.99 * kv6.wire_bytes, (kvw6.wire_bytes, kv6.wire_bytes)


# Greedy with every parameter that changes or reports the choice: a split must apply them as
# one vLLM request does, the presence and frequency penalties on the first token included
# (the decode request holds it in its prompt: engine/vllm/logits.py adds its share back).
SHAPED = SamplingParams(max_new_tokens=16, ignore_eos=True, repetition_penalty=1.2, presence_penalty=1.5,
                        frequency_penalty=1.0, min_tokens=3, logit_bias=((13, 2.5),), logprobs=3)  # fmt: skip


def test_the_sampling_specification_on_vllm_regions_split_as_one_vllm_request(
    regions: dict[str, RegionProcess], prompt: list[int]
) -> None:
    reference = _generate(regions["vllm-d"], prompt, SHAPED)

    decoded, _ = _split(regions["vllm-p"], regions["vllm-d"], prompt, SHAPED)

    assert _ids(decoded) == _ids(reference)
    assert _ids(reference) != _ids(_generate(regions["vllm-d"], prompt))  # the parameters took effect
    for ours, theirs in zip(decoded, reference, strict=True):
        assert list(ours.logprobs.top_ids) == list(theirs.logprobs.top_ids) and len(ours.logprobs.top_ids) == 3
        assert ours.logprobs.rank == theirs.logprobs.rank
        assert abs(ours.logprobs.logprob - theirs.logprobs.logprob) < 1e-3
        assert all(
            abs(a - b) < 1e-3 for a, b in zip(ours.logprobs.top_logprobs, theirs.logprobs.top_logprobs, strict=True)
        )


def test_seeded_sampling_on_vllm_regions_is_reproducible(regions: dict[str, RegionProcess], prompt: list[int]) -> None:
    """Each placement repeats itself; split and local share step 0 and then draw from vLLM's
    per-request generators (engine/vllm/sampling.py says why they differ after it)."""
    params = SamplingParams(max_new_tokens=12, temperature=0.9, top_p=0.9, top_k=40, seed=7, ignore_eos=True)
    split = [_ids(_split(regions["vllm-p"], regions["vllm-d"], prompt, params)[0]) for _ in range(2)]
    local = [_ids(_generate(regions["vllm-d"], prompt, params)) for _ in range(2)]

    assert split[0] == split[1] and local[0] == local[1]
    assert split[0][0] == local[0][0]
    other = _ids(_generate(regions["vllm-d"], prompt, dataclasses.replace(params, seed=8)))
    assert other != local[0]  # the seed is what repeats it


def test_vllm_region_refuses_what_it_cannot_serve(regions: dict[str, RegionProcess], prompt: list[int]) -> None:
    decode = _decode(regions["vllm-d"])
    choices = decode_pb2.GenerateRequest(
        job_id=str(uuid.uuid4()),
        token_ids=prompt[:8],
        timeout_s=10,
        sampling=sampling_to_proto(SamplingParams(max_new_tokens=4, temperature=0.7, seed=1, n=2)),
    )
    with pytest.raises(grpc.RpcError) as info:  # refused, never served as one choice
        list(decode.Generate(choices, timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "n=2" in info.value.details()
    unreserved = decode_pb2.DecodeRequest(
        job_id=str(uuid.uuid4()),
        attempt=1,
        first_token=1,
        token_ids=prompt[:8],
        sampling=sampling_to_proto(GREEDY),
        timeout_s=10,
    )
    with pytest.raises(grpc.RpcError) as info:
        list(decode.Decode(unreserved, timeout=30))
    assert info.value.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND)


def test_cancel_of_a_decode_waiting_for_its_kv_ends_it_at_once(
    regions: dict[str, RegionProcess], prompt: list[int]
) -> None:
    """No prefill ever comes: vLLM waits for the shipment; Cancel ends the call (CANCELLED)
    within a poll, frees the reservation, and the aborted request does not disturb the engine
    (vLLM aborts it once its load ended: a Generate right after gives the reference tokens)."""
    region = regions["vllm-d"]
    decode = _decode(region)
    reference = _ids(_generate(region, prompt))
    job = str(uuid.uuid4())
    decode.Reserve(
        decode_pb2.ReserveRequest(job_id=job, attempt=1, tenant="acme", kv_bytes=KV_BYTES, ttl_s=60), timeout=30
    )
    kv = common_pb2.KVDescriptor(model_fingerprint=model_fingerprint(resolve_model(MODEL)), dtype="float32",
                                 num_tokens=NUM_TOKENS, token_ids_hash=hash_token_ids(prompt))  # fmt: skip
    call = decode_pb2.DecodeRequest(job_id=job, attempt=1, first_token=reference[0], kv=kv, token_ids=prompt,
                                    sampling=sampling_to_proto(GREEDY), timeout_s=10)  # fmt: skip
    stream = decode.Decode(call, timeout=60)
    assert next(stream).token == reference[0]  # token 0 is the prefill's; then vLLM waits for the KV
    time.sleep(0.5)
    canceled = time.monotonic()
    assert decode.Cancel(common_pb2.CancelRequest(job_id=job, reason="test"), timeout=10).found
    with pytest.raises(grpc.RpcError) as info:
        list(stream)
    assert info.value.code() == grpc.StatusCode.CANCELLED
    assert time.monotonic() - canceled < 5
    assert _kv_used(region) == 0
    assert _ids(_generate(region, prompt)) == reference  # while and after the aborted request's load ends


def test_cancel_of_a_vllm_prefill_shipping_to_no_one_ends_it_at_once(
    regions: dict[str, RegionProcess], prompt: list[int]
) -> None:
    """A vLLM prefill whose destination takes the connection and never answers: its Cancel ends the Prefill
    call CANCELLED within seconds (the vLLM request is aborted), and the region serves the next job."""
    prefill = regions["vllm-p"]
    with socket.create_server(("127.0.0.1", 0)) as silent:
        job = str(uuid.uuid4())
        request = prefill_pb2.PrefillRequest(
            job_id=job, attempt=1, tenant="acme", token_ids=prompt, sampling=sampling_to_proto(GREEDY), timeout_s=60,
            destination=prefill_pb2.Destination(kv_endpoint=f"127.0.0.1:{silent.getsockname()[1]}", codec="raw",
                                                ticket=SIGNER.issue(job, 1, "acme", KV_BYTES, ttl_s=60),
                                                decode_region="vllm-d"),
        )  # fmt: skip
        stream = _prefill(prefill).Prefill(request, timeout=90)
        assert next(stream).HasField("started")
        time.sleep(1.0)
        canceled = time.monotonic()
        assert _prefill(prefill).Cancel(common_pb2.CancelRequest(job_id=job, reason="test"), timeout=10).found
        with pytest.raises(grpc.RpcError) as info:
            list(stream)
        assert info.value.code() == grpc.StatusCode.CANCELLED
        print(f"canceled in {time.monotonic() - canceled:.2f} s")
        assert time.monotonic() - canceled < 5


def test_region_exits_when_its_vllm_server_dies(regions: dict[str, RegionProcess]) -> None:
    """Last in the module: it takes the vLLM decode region down."""
    import psutil

    region = regions["vllm-d"]
    servers = [
        p for p in psutil.Process(region.proc.pid).children() if "prfaas.engine.vllm.server" in " ".join(p.cmdline())
    ]
    assert len(servers) == 1
    servers[0].send_signal(signal.SIGKILL)
    assert region.proc.wait(30) == 3  # the region stops: its launcher sees it fail
    with pytest.raises(grpc.RpcError) as info:
        _generate(region, [1, 2, 3])
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
