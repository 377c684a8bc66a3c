"""Builds a region process from its config: the engine, the agents its role needs, the
KV receiver of a decode role, and the server that hosts them (`prfaas region`)."""

from __future__ import annotations

from typing import Any

from prfaas.protos.prfaas.v1 import decode_pb2_grpc, prefill_pb2_grpc, registry_pb2
from prfaas.protos.region_config import RegionConfig, parse_hostport
from prfaas.protos.region_server import Agent, RegionServer


def build_region(config: RegionConfig) -> tuple[RegionServer, registry_pb2.RegisterRequest]:
    from prfaas.decode_region.agent import DecodeAgent
    from prfaas.engine.hf import HFEngine
    from prfaas.prefill_region.agent import PrefillAgent
    from prfaas.transport.tcp_server import TcpReceiver
    from prfaas.transport.tickets import TicketVerifier

    engine = HFEngine(config.model, dtype=config.dtype, device=config.device)
    agents: dict[str, tuple[Agent, Any]] = {}
    kv_endpoint = ""
    if config.serves_prefill:
        prefill = PrefillAgent(
            engine, num_workers=config.workers, queue_depth=config.queue_depth, codec=config.codec,
            kv_lease_s=config.kv_lease_s, kv_lease_bytes=config.kv_lease_bytes, node=config.name,
            test_layer_delay_s=config.test_layer_delay_s,
        )  # fmt: skip
        agents["prfaas.v1.PrefillRegion"] = (prefill, prefill_pb2_grpc.add_PrefillRegionServicer_to_server)
    if config.serves_decode:
        host, port = parse_hostport(config.listen.kv)
        verifier = TicketVerifier({config.ticket_key_id: config.ticket_key.encode()})
        receiver = TcpReceiver(verifier, host, port, node=config.name)
        kv_endpoint = f"{host}:{receiver.address[1]}"
        decode = DecodeAgent(
            engine, receiver, kv_endpoint=kv_endpoint, kv_buffer_bytes=config.kv_buffer_bytes,
            num_workers=config.workers, heartbeat_interval_s=config.heartbeat_interval_s,
            max_reservation_s=config.max_reservation_s,
        )  # fmt: skip
        agents["prfaas.v1.DecodeRegion"] = (decode, decode_pb2_grpc.add_DecodeRegionServicer_to_server)
    threads = 16 + 4 * config.workers + config.queue_depth  # streams held open by queued jobs need threads too
    server = RegionServer(config.listen.grpc, agents, metrics_address=config.listen.metrics, max_rpc_threads=threads)
    registration = registry_pb2.RegisterRequest(
        name=config.name, role=config.role, gpu_type=config.gpu_type, num_workers=config.workers,
        usd_per_gpu_hour=config.usd_per_gpu_hour, grpc_endpoint=server.grpc_address, kv_endpoint=kv_endpoint,
        engine=config.engine, model=config.model, model_fingerprint=engine.fingerprint,
        kv_buffer_bytes=config.kv_buffer_bytes if config.serves_decode else 0,
        heartbeat_interval_s=config.heartbeat_interval_s,
    )  # fmt: skip
    return server, registration
