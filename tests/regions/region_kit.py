"""Helpers for the region tests: regions in this process (real gRPC servers and KV
sockets on loopback) or as real `prfaas region` processes, tickets, and a caller that
drives a split job the way the control plane will (Reserve -> Prefill -> Decode)."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from prfaas.decode_region.agent import DecodeAgent
from prfaas.decode_region.hf_backend import HFDecode
from prfaas.decode_region.role import build_decode
from prfaas.devstack.processes import LOOPBACK_REGION, write_region_config
from prfaas.devstack.stack import RegionProcess as RegionProcess  # shared with the control-plane tests
from prfaas.devstack.stack import spawn_region as spawn_region
from prfaas.devstack.stack import wait_until as wait_until
from prfaas.engine.hf import HFEngine
from prfaas.engine.sampling import SamplingParams
from prfaas.prefill_region.agent import PrefillAgent
from prfaas.prefill_region.hf_backend import HFPrefill, Leases
from prfaas.prefill_region.role import build_prefill
from prfaas.protos.prfaas.v1 import (
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
    registry_pb2,
)
from prfaas.region.build import build_region
from prfaas.region.config import config_from_mapping
from prfaas.region.requests import sampling_to_proto
from prfaas.region.server import RegionServer
from prfaas.transport.tickets import TicketSigner

KEY = b"region-tests-ticket-key-0123456789abcdef"
ROLES = {"prefill": build_prefill, "decode": build_decode}  # as `prfaas region` builds them
SIGNER = TicketSigner({"k1": KEY}, "k1")
FORGER = TicketSigner({"k1": b"not-the-region-key-0123456789abcdef!!"}, "k1")


def new_job() -> str:
    return str(uuid.uuid4())


def ticket(
    job_id: str, attempt: int = 1, tenant: str = "acme", budget: int = 1 << 34, signer: TicketSigner = SIGNER
) -> str:
    return signer.issue(job_id, attempt, tenant, budget, ttl_s=60)


@dataclass
class Region:
    """A region served from this process."""

    server: RegionServer
    prefill: PrefillAgent | None = None
    decode: DecodeAgent | None = None
    registration: registry_pb2.RegisterRequest | None = None  # what it tells the control plane
    channel: grpc.Channel = field(init=False)

    def __post_init__(self) -> None:
        self.channel = grpc.insecure_channel(self.server.grpc_address)

    @property
    def prefill_stub(self) -> prefill_pb2_grpc.PrefillRegionStub:
        return prefill_pb2_grpc.PrefillRegionStub(self.channel)

    @property
    def decode_stub(self) -> decode_pb2_grpc.DecodeRegionStub:
        return decode_pb2_grpc.DecodeRegionStub(self.channel)

    @property
    def leases(self) -> Leases:
        assert self.prefill is not None and isinstance(self.prefill.backend, HFPrefill)
        return self.prefill.backend.leases

    def close(self) -> None:
        self.channel.close()
        self.server.stop(0.2)
        if self.decode is not None and isinstance(self.decode.backend, HFDecode):
            self.decode.backend.receiver.close()


class IdleAgent:
    """An agent with no work, for a region server alone (region/server.py `Agent`)."""

    draining = False

    def load(self) -> dict[str, float]:
        return {"kv_free_bytes": 1000}

    def link_reports(self) -> list[registry_pb2.LinkReport]:
        return []

    def idle(self) -> bool:
        return True

    def close(self) -> None:
        pass


def local_region(
    engine: HFEngine,
    *,
    prefill: bool = True,
    decode: bool = True,
    kv_buffer_bytes: int = 1 << 30,
    workers: int = 1,
    queue_depth: int = 4,
    codec: str = "raw",
    metrics: bool = False,
    heartbeat_s: float = 0.5,
    registry: tuple[str, registry_pb2.RegisterRequest, float] | None = None,
    name: str = "test",
    tls: dict[str, str] | None = None,
    max_jobs: int = 64,
    token_delay_s: float = 0.0,
) -> Region:
    """A region built as `prfaas region` builds one (region/build.py), on `engine`; `tls`: its
    ca / cert / key files (mutual TLS on gRPC and KV)."""
    role = "both" if prefill and decode else "prefill" if prefill else "decode"
    config = config_from_mapping({
        "name": name, "role": role, "ticket_key": KEY.decode(), "ticket_key_id": "k1", "workers": workers, "tls": tls,
        "instance": "1",
        "queue_depth": queue_depth, "codec": codec, "kv_buffer_bytes": kv_buffer_bytes,
        "heartbeat_interval_s": heartbeat_s, "max_jobs": max_jobs, "test_token_delay_s": token_delay_s,
        "listen": {"grpc": "127.0.0.1:0", "kv": "127.0.0.1:0", "metrics": "127.0.0.1:0" if metrics else None},
    })  # fmt: skip
    server, registration = build_region(config, ROLES, engine)
    server.start(registry)
    agents = {name: agent for name, (agent, _add) in server.agents.items()}
    p, d = agents.get("prfaas.v1.PrefillRegion"), agents.get("prfaas.v1.DecodeRegion")
    assert p is None or isinstance(p, PrefillAgent)
    assert d is None or isinstance(d, DecodeAgent)
    return Region(server, p, d, registration)


@dataclass
class SplitRun:
    job_id: str
    tokens: list[int]
    events: list[prefill_pb2.PrefillEvent]
    token_events: list[decode_pb2.TokenEvent]
    ttft_s: float  # from the start of Prefill to token 0 out of the decode region


def reserve(
    decode: decode_pb2_grpc.DecodeRegionStub,
    job_id: str,
    kv_bytes: int,
    *,
    attempt: int = 1,
    ttl_s: float = 60,
    prefill_grpc: str = "",
) -> decode_pb2.ReserveReply:
    request = decode_pb2.ReserveRequest(
        job_id=job_id, attempt=attempt, tenant="acme", kv_bytes=kv_bytes, ttl_s=ttl_s, prefill_grpc=prefill_grpc
    )
    reply: decode_pb2.ReserveReply = decode.Reserve(request, timeout=10)
    return reply


def prefill_request(
    job_id: str,
    token_ids: list[int],
    params: SamplingParams,
    kv_endpoint: str,
    *,
    attempt: int = 1,
    codec: str = "raw",
    whole: bool = False,
    signer: TicketSigner = SIGNER,
    timeout_s: float = 60,
    budget: int = 1 << 34,
) -> prefill_pb2.PrefillRequest:
    """`budget`: the ticket's, which must equal the decode reservation's KV bytes (as the
    control plane signs it) wherever a reservation names them."""
    return prefill_pb2.PrefillRequest(
        job_id=job_id,
        attempt=attempt,
        tenant="acme",
        token_ids=token_ids,
        sampling=sampling_to_proto(params),
        destination=prefill_pb2.Destination(
            kv_endpoint=kv_endpoint, ticket=ticket(job_id, attempt, signer=signer, budget=budget), codec=codec
        ),
        timeout_s=timeout_s,
        ship_whole=whole,
    )


def split_generate(
    prefill: prefill_pb2_grpc.PrefillRegionStub,
    decode: decode_pb2_grpc.DecodeRegionStub,
    token_ids: list[int],
    params: SamplingParams,
    kv_bytes: int,
    *,
    codec: str = "raw",
    whole: bool = False,
    prefill_grpc: str = "",
) -> SplitRun:
    """What the control plane does for a split job."""
    job_id = new_job()
    reply = reserve(decode, job_id, kv_bytes, prefill_grpc=prefill_grpc)
    start = time.perf_counter()
    events: list[prefill_pb2.PrefillEvent] = []
    done: prefill_pb2.PrefillDone | None = None
    stream = prefill.Prefill(
        prefill_request(job_id, token_ids, params, reply.kv_endpoint, codec=codec, whole=whole, budget=kv_bytes),
        timeout=120,
    )
    token_events: list[decode_pb2.TokenEvent] = []
    ttft = 0.0
    decoder: threading.Thread | None = None
    errors: list[BaseException] = []

    def run_decode(first: prefill_pb2.PrefillDone) -> None:
        nonlocal ttft
        try:
            for event in decode.Decode(decode_request(job_id, params, first), timeout=120):
                if event.index == 0:
                    ttft = time.perf_counter() - start
                token_events.append(event)
        except BaseException as exc:
            errors.append(exc)

    for event in stream:
        events.append(event)
        if event.HasField("prefill_done"):
            done = event.prefill_done
            decoder = threading.Thread(target=run_decode, args=(done,))
            decoder.start()
    assert decoder is not None
    decoder.join(120)
    if errors:
        raise errors[0]
    return SplitRun(job_id, [e.token for e in token_events], events, token_events, ttft)


def decode_request(
    job_id: str,
    params: SamplingParams,
    done: prefill_pb2.PrefillDone | prefill_pb2.ReshipReply | None = None,
    *,
    attempt: int = 1,
    kv: common_pb2.KVDescriptor | None = None,
    timeout_s: float = 120.0,
) -> decode_pb2.DecodeRequest:
    """A Decode of `job_id` from what its prefill (or re-shipment) reported; `kv` without one."""
    first_token = done.first_token if done is not None else 0
    descriptor = done.kv if done is not None else kv
    return decode_pb2.DecodeRequest(job_id=job_id, attempt=attempt, first_token=first_token, kv=descriptor,
                                    sampling=sampling_to_proto(params), timeout_s=timeout_s)  # fmt: skip


def generate_tokens(
    decode: decode_pb2_grpc.DecodeRegionStub, token_ids: list[int], params: SamplingParams
) -> list[int]:
    request = decode_pb2.GenerateRequest(
        job_id=new_job(), token_ids=token_ids, sampling=sampling_to_proto(params), timeout_s=120
    )
    return [event.token for event in decode.Generate(request, timeout=120)]


def cancel(stub: Any, job_id: str) -> bool:
    return bool(stub.Cancel(common_pb2.CancelRequest(job_id=job_id, reason="test"), timeout=5).found)


# -- regions as real processes -------------------------------------------------------------


def write_config(folder: Path, **fields: Any) -> Path:
    config = LOOPBACK_REGION | {"role": "both", "model": "tiny-llama", "ticket_key": KEY.decode()} | fields
    return write_region_config(folder / f"{config['name']}.yaml", config)


def metric(metrics_address: str, name: str) -> float:
    """A sample's value from a region's /metrics (0 when absent)."""
    import urllib.request

    with urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=5) as response:
        for line in response.read().decode().splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def events_kinds(events: list[prefill_pb2.PrefillEvent]) -> Iterator[str]:
    for event in events:
        yield str(event.WhichOneof("event"))
