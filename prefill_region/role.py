"""The prefill role of a region process: its agent on the region's engine, from the region
config (`region.build.RoleBuilder`). HF engine: `HFPrefill` shipping over prfaas's transports;
vLLM server: `VLLMPrefill`, whose connector ships."""

from __future__ import annotations

from typing import Any

from prfaas.prefill_region.agent import PrefillAgent
from prfaas.prefill_region.backend import PrefillBackend
from prfaas.protos.prfaas.v1 import prefill_pb2_grpc
from prfaas.region.build import BuiltRole
from prfaas.region.config import RegionConfig, ice_servers


def build_prefill(config: RegionConfig, engine: Any) -> BuiltRole:
    backend: PrefillBackend
    if config.engine == "vllm":
        from prfaas.prefill_region.vllm_backend import VLLMPrefill

        backend = VLLMPrefill(engine, ship=config.vllm.ship)
    else:
        from prfaas.prefill_region.hf_backend import HFPrefill
        from prfaas.prefill_region.shipping import ChannelPool

        channels = ChannelPool(config.name, control_plane=config.control_plane_url, ice_servers=ice_servers(config),
                               tls=config.tls)  # fmt: skip
        backend = HFPrefill(engine, channels, kv_lease_s=config.kv_lease_s, kv_lease_bytes=config.kv_lease_bytes,
                            test_layer_delay_s=config.test_layer_delay_s,
                            staging_bytes=config.staging_bytes)  # fmt: skip
    agent = PrefillAgent(backend, num_workers=config.workers, queue_depth=config.queue_depth, codec=config.codec)
    return BuiltRole("prfaas.v1.PrefillRegion", agent, prefill_pb2_grpc.add_PrefillRegionServicer_to_server)
