"""Builds a region process from its config: the engine, the role backends on it, the agents
its role needs, the KV receiver of a decode role, and the server that hosts them. The only
place that sees both roles and both engines; the agents see only their backend Protocols."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from prfaas.protos.prfaas.v1 import decode_pb2_grpc, prefill_pb2_grpc, registry_pb2
from prfaas.region.config import RegionConfig, parse_hostport
from prfaas.region.server import Agent, RegionServer

log = logging.getLogger(__name__)
Agents = dict[str, tuple[Agent, Any]]


def build_region(config: RegionConfig, engine: Any = None) -> tuple[RegionServer, registry_pb2.RegisterRequest]:
    """The region's server (not started) and what it registers with. `engine`: an HFEngine
    already loaded (tests share one); None loads the config's model."""
    if config.engine == "vllm":
        return _build_vllm_region(config)
    from prfaas.decode_region.hf_backend import HFDecode
    from prfaas.engine.hf import HFEngine
    from prfaas.prefill_region.hf_backend import HFPrefill
    from prfaas.prefill_region.shipping import ChannelPool
    from prfaas.transport.tickets import TicketVerifier

    if config.engine_cpus:  # every thread made from here on keeps off the forward's CPUs, if others exist
        others = set(range(os.cpu_count() or 1)) - set(config.engine_cpus)
        os.sched_setaffinity(0, others or set(config.engine_cpus))
    if engine is None:
        engine = HFEngine(config.model, dtype=config.dtype, device=config.device, cpus=config.engine_cpus)
    agents: Agents = {}
    kv_endpoint = ""
    if config.serves_prefill:
        channels = ChannelPool(config.name, control_plane=config.control_plane_url, ice_servers=ice_servers(config))
        prefill = HFPrefill(engine, channels, kv_lease_s=config.kv_lease_s, kv_lease_bytes=config.kv_lease_bytes,
                            test_layer_delay_s=config.test_layer_delay_s)  # fmt: skip
        _add_prefill(agents, config, prefill)
    if config.serves_decode:
        host, port = parse_hostport(config.listen.kv)
        verifier = TicketVerifier({config.ticket_key_id: config.ticket_key.encode()})
        receiver, kv_endpoint = kv_receiver(config, verifier, host, port)
        _add_decode(agents, config, HFDecode(engine, receiver, kv_endpoint))
    server = _server(config, agents)
    return server, _registration(config, server, kv_endpoint, engine.fingerprint)


def _build_vllm_region(config: RegionConfig) -> tuple[RegionServer, registry_pb2.RegisterRequest]:
    """`engine: vllm`: one vLLM server for the region (engine/vllm/remote.py); its KV port is
    the region's (listen.kv) when it decodes. The region exits if the server dies."""
    from prfaas.decode_region.vllm_backend import VLLMDecode
    from prfaas.engine.vllm.remote import DEFAULT_VLLM_PYTHON, ServerOptions, start_vllm_engine
    from prfaas.prefill_region.vllm_backend import VLLMPrefill

    opts = config.vllm
    host, port = parse_hostport(config.listen.kv)
    engine = start_vllm_engine(
        config.model, dtype=config.dtype, node=config.name, kv_host=host, kv_port=port,
        ticket_keys={config.ticket_key_id: config.ticket_key.encode()} if config.serves_decode else None,
        options=ServerOptions(
            python=Path(opts.python) if opts.python else DEFAULT_VLLM_PYTHON, start_timeout_s=opts.start_timeout_s,
            enforce_eager=opts.enforce_eager, max_model_len=opts.max_model_len, kv_cache_gib=opts.kv_cache_gib,
            cpu_threads_bind=opts.cpu_threads_bind, log_path=Path(opts.log) if opts.log else None,
        ),
    )  # fmt: skip
    agents: Agents = {}
    try:
        if config.serves_prefill:
            _add_prefill(agents, config, VLLMPrefill(engine, ship=opts.ship))
        if config.serves_decode:
            _add_decode(agents, config, VLLMDecode(engine))
        server = _server(config, agents)
    except BaseException:
        engine.close()
        raise

    def engine_died(returncode: int) -> None:
        # A region without its engine serves nothing: exit at once (callers in flight get
        # UNAVAILABLE, heartbeats stop) with a status its launcher sees as a failure.
        log.error("region %s: its vLLM server exited with %d; the region exits", config.name, returncode)
        logging.shutdown()
        os._exit(3)

    engine.on_exit(engine_died)
    return server, _registration(config, server, engine.kv_endpoint or "", engine.fingerprint)


def _add_prefill(agents: Agents, config: RegionConfig, backend: Any) -> None:
    from prfaas.prefill_region.agent import PrefillAgent

    agent = PrefillAgent(backend, num_workers=config.workers, queue_depth=config.queue_depth, codec=config.codec)
    agents["prfaas.v1.PrefillRegion"] = (agent, prefill_pb2_grpc.add_PrefillRegionServicer_to_server)


def _add_decode(agents: Agents, config: RegionConfig, backend: Any) -> None:
    from prfaas.decode_region.agent import DecodeAgent

    agent = DecodeAgent(
        backend, kv_buffer_bytes=config.kv_buffer_bytes, num_workers=config.workers,
        heartbeat_interval_s=config.heartbeat_interval_s, max_reservation_s=config.max_reservation_s,
    )  # fmt: skip
    agents["prfaas.v1.DecodeRegion"] = (agent, decode_pb2_grpc.add_DecodeRegionServicer_to_server)


def _server(config: RegionConfig, agents: Agents) -> RegionServer:
    threads = 16 + 4 * config.workers + config.queue_depth  # streams held open by queued jobs need threads too
    return RegionServer(config.listen.grpc, agents, metrics_address=config.listen.metrics, max_rpc_threads=threads)


def _registration(
    config: RegionConfig, server: RegionServer, kv_endpoint: str, fingerprint: str
) -> registry_pb2.RegisterRequest:
    return registry_pb2.RegisterRequest(
        name=config.name, role=config.role, gpu_type=config.gpu_type, num_workers=config.workers,
        usd_per_gpu_hour=config.usd_per_gpu_hour, grpc_endpoint=server.grpc_address, kv_endpoint=kv_endpoint,
        engine=config.engine, model=config.model, model_fingerprint=fingerprint,
        kv_buffer_bytes=config.kv_buffer_bytes if config.serves_decode else 0,
        heartbeat_interval_s=config.heartbeat_interval_s,
    )  # fmt: skip


def ice_servers(config: RegionConfig) -> tuple[Any, ...]:
    from prfaas.transport.webrtc import IceServer

    return tuple(IceServer(tuple(s.urls), s.username, s.credential) for s in config.ice_servers)


def kv_receiver(config: RegionConfig, verifier: Any, host: str, port: int) -> tuple[Any, str]:
    """The decode role's KV receiver and the endpoint(s) it registers (transport/endpoints.py):
    TCP plus same-host shared memory sharing one set of expected shipments, or WebRTC."""
    if config.transport == "webrtc":
        from prfaas.region.signal_client import OfferListener
        from prfaas.transport.webrtc_receiver import WebRtcReceiver

        assert config.control_plane_url is not None  # the config validates it
        rtc = WebRtcReceiver(verifier, node=config.name, ice_servers=ice_servers(config))
        OfferListener(config.control_plane_url, config.name, rtc.answer).start()
        return rtc, f"webrtc://{config.name}"
    from prfaas.transport.arena import Arena
    from prfaas.transport.shm_receiver import ShmReceiver
    from prfaas.transport.tcp_receiver import TcpReceiver

    arena = Arena(config.shm_arena_bytes) if config.shm else None
    tcp = TcpReceiver(verifier, host, port, node=config.name, pool=arena)
    endpoint = f"{host}:{tcp.address[1]}"
    if arena is not None:
        shm = ShmReceiver(verifier, node=config.name, arena=arena, core=tcp.core)
        endpoint += f",{shm.endpoint}"
    return tcp, endpoint
