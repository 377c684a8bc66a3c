"""The decode role of a region process: its agent on the region's engine, from the region
config (`region.build.RoleBuilder`). HF engine: `HFDecode` with this process's KV receiver
(TCP plus same-host shared memory, or WebRTC); vLLM server: `VLLMDecode`, whose server
receives the KV on the region's KV port."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prfaas.decode_region.agent import DecodeAgent
from prfaas.decode_region.backend import DecodeBackend
from prfaas.protos.prfaas.v1 import decode_pb2_grpc
from prfaas.region.addresses import advertised_host
from prfaas.region.build import BuiltRole
from prfaas.region.config import RegionConfig, ice_servers
from prfaas.transport.endpoints import hostport, parse_hostport
from prfaas.transport.inbound import Receiver
from prfaas.transport.tickets import TicketVerifier


def build_decode(config: RegionConfig, engine: Any) -> BuiltRole:
    backend: DecodeBackend
    if config.engine == "vllm":
        from prfaas.decode_region.vllm_backend import VLLMDecode

        backend = VLLMDecode(engine, kv_host=advertised_host(config, "kv"))
    else:
        from prfaas.decode_region.hf_backend import HFDecode

        receiver, kv_endpoint, stop_signalling = kv_receiver(config)
        backend = HFDecode(engine, receiver, kv_endpoint, test_token_delay_s=config.test_token_delay_s,
                           staging_bytes=config.staging_bytes, on_close=stop_signalling)  # fmt: skip
    agent = DecodeAgent(
        backend, kv_buffer_bytes=config.kv_buffer_bytes, num_workers=config.workers,
        heartbeat_interval_s=config.heartbeat_interval_s, max_reservation_s=config.max_reservation_s,
        max_jobs=config.max_jobs, tls=config.tls,
    )  # fmt: skip
    add = decode_pb2_grpc.add_DecodeRegionServicer_to_server
    return BuiltRole("prfaas.v1.DecodeRegion", agent, add, backend.kv_endpoint)


def kv_receiver(config: RegionConfig) -> tuple[Receiver, str, Callable[[], None] | None]:
    """The decode role's KV receiver, the endpoint(s) it registers (transport/endpoints.py), and what
    stops its signalling when the role closes (None: none): TCP plus same-host shared memory sharing
    one set of expected shipments, or WebRTC, whose offers come through the control plane.

    A WebRTC region's offers are addressed to the region, not to one of its instances: the registry
    lets one instance of it be alive at a time (control_plane/fleet/registry.py)."""
    verifier = TicketVerifier(config.ticket_keys)
    if config.transport == "webrtc":
        from prfaas.region.signal_client import OfferListener
        from prfaas.transport.webrtc_receiver import WebRtcReceiver

        assert config.control_plane_url is not None  # the config validates it
        rtc = WebRtcReceiver(verifier, node=config.name, ice_servers=ice_servers(config))
        listener = OfferListener(config.control_plane_url, config.name, rtc.answer, config.tls,
                                 interval_s=config.heartbeat_interval_s)  # fmt: skip
        listener.start()
        return rtc, f"webrtc://{config.name}", listener.stop
    from prfaas.transport.arena import Arena
    from prfaas.transport.shm_receiver import ShmReceiver
    from prfaas.transport.tcp_receiver import TcpReceiver
    from prfaas.transport.tls import server_context

    host, port = parse_hostport(config.listen.kv)
    arena = Arena(config.shm_arena_bytes) if config.shm else None
    tls = server_context(config.tls.node_cert()) if config.tls is not None else None
    tcp = TcpReceiver(verifier, host, port, node=config.name, pool=arena, ssl_context=tls)
    endpoint = hostport(advertised_host(config, "kv"), tcp.address[1])
    if arena is not None:
        shm = ShmReceiver(verifier, node=config.name, arena=arena, core=tcp.core)
        endpoint += f",{shm.endpoint}"
    return tcp, endpoint, None
