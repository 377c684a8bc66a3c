"""A vLLM decode region's reservation drops its registration in the vLLM server however it ends
(decode_region/vllm_backend.py, `ServerHold.end`), even when a Decode claimed it and never sent a
vLLM request: max_tokens 1, EOS as the first token. The agent and the hold are what is under test;
the vLLM server behind them is a recording stand-in of `VLLMEngine`'s surface (tests/vllm run the
real one), served on a real gRPC server in this process."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest
from region_kit import decode_request, new_job, reserve

from prfaas.decode_region.agent import DecodeAgent
from prfaas.decode_region.vllm_backend import VLLMDecode
from prfaas.engine.base import ModelFacts
from prfaas.engine.models import prepare_model, resolve_model
from prfaas.engine.sampling import Chosen, SamplingParams
from prfaas.engine.vllm.params import LOAD_KEY
from prfaas.protos.prfaas.v1 import common_pb2, decode_pb2_grpc
from prfaas.transport.endpoints import parse_endpoints


class RecordingServer:
    """What VLLMDecode calls on a vLLM server: registrations (`expect`, `forget`) and requests, whose load
    takes the job's registration, as the connector's `KVLink.take` does."""

    prefix_cache = None
    kv_endpoint = "127.0.0.1:9"

    def __init__(self) -> None:
        prepare_model("tiny-llama")
        self.model_path = resolve_model("tiny-llama")
        self.facts = ModelFacts.read("tiny-llama", "float32")
        self.registered: set[tuple[str, int]] = set()
        self.requests = 0
        self.lock = threading.Lock()

    def expect(self, job_id: str, attempt: int, ttl_s: float, **_: Any) -> None:
        with self.lock:
            self.registered.add((job_id, attempt))

    def forget(self, job_id: str, attempt: int) -> bool:
        with self.lock:
            found = (job_id, attempt) in self.registered
            self.registered.discard((job_id, attempt))
        return found

    def stream(self, token_ids: list[int], max_tokens: int, stop: Any = None, **options: Any) -> Iterator[Chosen]:
        load = (options.get("kv_params") or {}).get(LOAD_KEY)
        with self.lock:
            self.requests += 1
            if load is not None:
                self.registered.discard((load["job_id"], load["attempt"]))
        for step in range(max_tokens):
            yield Chosen(token=100 + step)

    def close(self) -> None:
        pass


@pytest.fixture(scope="module")
def server() -> RecordingServer:
    return RecordingServer()


@pytest.fixture(scope="module")
def stub(server: RecordingServer) -> Iterator[decode_pb2_grpc.DecodeRegionStub]:
    agent = DecodeAgent(VLLMDecode(server), kv_buffer_bytes=1 << 20)  # type: ignore[arg-type]
    grpc_server = grpc.server(futures.ThreadPoolExecutor(4))
    decode_pb2_grpc.add_DecodeRegionServicer_to_server(agent, grpc_server)
    port = grpc_server.add_insecure_port("127.0.0.1:0")
    grpc_server.start()
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield decode_pb2_grpc.DecodeRegionStub(channel)
    grpc_server.stop(None)
    agent.close()


@pytest.mark.parametrize(
    ("max_new_tokens", "first_token", "requests"),
    [(1, 5, 0), (8, None, 0), (8, 5, 1)],  # max_tokens 1; EOS first (None: the model's EOS); a request sent
)
def test_a_vllm_reservation_leaves_no_registration_in_the_server(
    server: RecordingServer, stub: decode_pb2_grpc.DecodeRegionStub, max_new_tokens: int, first_token: int | None,
    requests: int,
) -> None:  # fmt: skip
    job_id, prompt = new_job(), [1, 2, 3, 4]
    first = min(server.facts.eos_token_ids) if first_token is None else first_token
    reserve(stub, job_id, 1000)
    assert (job_id, 1) in server.registered
    before = server.requests
    kv = common_pb2.KVDescriptor(model_fingerprint=server.facts.fingerprint, dtype="float32", num_tokens=len(prompt))
    request = decode_request(job_id, SamplingParams(max_new_tokens=max_new_tokens), kv=kv)
    request.first_token, request.token_ids[:] = first, prompt
    tokens = [event.token for event in stub.Decode(request, timeout=30)]
    assert tokens[0] == first and len(tokens) == (1 if requests == 0 else max_new_tokens)
    assert server.requests - before == requests
    assert (job_id, 1) not in server.registered


@pytest.mark.parametrize(
    ("listen", "advertised", "expected"),
    [
        ("0.0.0.0:7400", "2001:db8::5", "[2001:db8::5]:7400"),
        ("[::]:7400", "::1", "[::1]:7400"),
        ("[::1]:7400", None, "[::1]:7400"),
        ("0.0.0.0:7400", "10.0.0.5", "10.0.0.5:7400"),
    ],
)
def test_a_vllm_decode_regions_kv_endpoint_is_one_prefill_regions_can_dial(
    listen: str, advertised: str | None, expected: str
) -> None:
    """The endpoint a vLLM decode region hands out in its Reserve replies, with an IPv6 host advertised: `[v6]:port`,
    which every prefill region parses (`2001:db8::5:7400` was refused, and every split job to the region failed)."""
    server = RecordingServer.__new__(RecordingServer)  # the engine's endpoint only: no model needed
    server.kv_endpoint = listen
    server.facts = None  # type: ignore[assignment]
    decode = VLLMDecode(server, advertised)  # type: ignore[arg-type]
    assert decode.kv_endpoint == expected
    (endpoint,) = parse_endpoints(decode.kv_endpoint)
    assert str(endpoint) == expected
