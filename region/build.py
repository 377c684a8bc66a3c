"""Builds a region process from its config: the engine (HF in this process, or a vLLM server
beside it), then the agent of each role the config serves, and the server that hosts them.

The roles are given, not imported: each role package provides a `RoleBuilder`
(`prefill_region/role.py`, `decode_region/role.py`) and the process's entry point passes
them in (`cli/main.py`: `prfaas region`), so the host depends on no role and the roles
depend on the host (docs/ARCHITECTURE.md).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import grpc
from prometheus_client import Gauge

from prfaas.protos.prfaas.v1 import registry_pb2
from prfaas.region.addresses import advertised_host
from prfaas.region.channels import MAX_PREFIX_BLOCKS
from prfaas.region.config import RegionConfig
from prfaas.region.requests import MAX_RESHIPS
from prfaas.region.server import Agent, RegionServer
from prfaas.transport.endpoints import hostport, parse_hostport

log = logging.getLogger(__name__)
DEVICE_INFO = Gauge("prfaas_region_device_info", "1 for the device and dtype the region's engine runs on",
                    ["device", "dtype", "name"])  # fmt: skip


class BuiltRole(NamedTuple):
    service: str  # the gRPC service it serves, e.g. "prfaas.v1.PrefillRegion"
    agent: Agent
    add_to_server: Callable[[Any, grpc.Server], None]  # the generated add_*Servicer_to_server
    kv_endpoint: str = ""  # where prefill regions ship KV to this role (decode), else ""


class RoleBuilder(Protocol):
    def __call__(self, config: RegionConfig, engine: Any) -> BuiltRole:
        """The role's agent on `engine` (an `HFEngine` or a `VLLMEngine`)."""
        ...


def build_region(
    config: RegionConfig, roles: Mapping[str, RoleBuilder], engine: Any = None
) -> tuple[RegionServer, registry_pb2.RegisterRequest]:
    """The region's server (not started) and what it registers with. `roles` maps "prefill"
    and "decode" to their builders; `engine`: one already loaded (tests share one), or None
    to load the config's."""
    owned = engine is None
    if engine is None:
        engine = load_engine(config)
    try:
        wanted = ("prefill", "decode") if config.role == "both" else (config.role,)
        built = [roles[role](config, engine) for role in wanted]
        # streams held open by queued prefill jobs, Reships and a decode role's jobs (max_jobs) need threads too
        threads = 16 + 4 * config.workers + config.queue_depth + (config.max_jobs if "decode" in wanted else 0)
        threads += MAX_RESHIPS if "prefill" in wanted else 0
        prefix_cache = getattr(engine, "prefix_cache", None)  # the HF engine's; a vLLM region reports none yet
        server = RegionServer(
            config.listen.grpc, {b.service: (b.agent, b.add_to_server) for b in built},
            metrics_address=config.listen.metrics, max_rpc_threads=threads, tls=config.tls, prefix_cache=prefix_cache,
        )  # fmt: skip
    except BaseException:
        if owned and config.engine == "vllm":
            engine.close()
        raise
    server.device = getattr(engine, "device_choice", None)
    if server.device is not None:
        DEVICE_INFO.labels(server.device.device, server.device.dtype, server.device.name).set(1)
    grpc_port = parse_hostport(server.grpc_address)[1]
    registration = registry_pb2.RegisterRequest(
        name=config.name, role=config.role, gpu_type=config.gpu_type, num_workers=config.workers,
        usd_per_gpu_hour=config.usd_per_gpu_hour, grpc_endpoint=hostport(advertised_host(config), grpc_port),
        instance=config.instance,
        kv_endpoint=next((b.kv_endpoint for b in built if b.kv_endpoint), ""), engine=config.engine,
        model=config.model, model_fingerprint=engine.facts.fingerprint,
        kv_buffer_bytes=config.kv_buffer_bytes if config.identity.serves_decode else 0,
        heartbeat_interval_s=config.heartbeat_interval_s,
        prefix_block_tokens=prefix_cache.block_tokens if prefix_cache is not None else 0,
        kv_dtype=engine.facts.dtype, queue_limit=config.queue_depth if wanted == ("prefill",) else 0,
    )  # fmt: skip
    return server, registration


def load_engine(config: RegionConfig) -> Any:
    """`engine: hf`: the model in this process (its forwards pinned to `engine_cpus`, every
    other thread off them). `engine: vllm`: a vLLM server beside the region
    (engine/vllm/remote.py), its KV port the region's (listen.kv) when it decodes; the region
    exits if the server dies."""
    if config.engine == "hf":
        from prfaas.engine.hf import HFEngine

        if config.engine_cpus:  # every thread made from here on keeps off the forward's CPUs, if others exist
            others = set(range(os.cpu_count() or 1)) - set(config.engine_cpus)
            os.sched_setaffinity(0, others or set(config.engine_cpus))
        from prfaas.engine.device import select_device
        from prfaas.engine.prefix_cache import PrefixCache

        cache = (
            PrefixCache(config.prefix_block_tokens, config.prefix_cache_bytes, publish_limit=MAX_PREFIX_BLOCKS)
            if config.prefix_cache_bytes
            else None
        )
        choice = select_device(config.device, config.dtype)
        hf = HFEngine(
            config.model, dtype=choice.dtype, device=choice.device, cpus=config.engine_cpus, prefix_cache=cache
        )
        hf.device_choice = choice
        return hf
    from prfaas.engine.device import select_device
    from prfaas.engine.vllm.remote import DEFAULT_VLLM_PYTHON, ServerOptions, cuda_of, start_vllm_engine

    opts = config.vllm
    host, port = parse_hostport(config.listen.kv)
    python = Path(opts.python) if opts.python else DEFAULT_VLLM_PYTHON
    # the vLLM server picks its own device: device and dtype follow what its environment's torch sees
    # (asked only when the choice depends on it: `device: cpu` needs no GPU count)
    choice = select_device(config.device, config.dtype, cuda_of(python) if config.device != "cpu" else None)
    engine = start_vllm_engine(
        config.model, dtype=choice.dtype, node=config.name, kv_host=host, kv_port=port,
        ticket_keys=config.ticket_keys if config.identity.serves_decode else None,
        options=ServerOptions(
            python=python, start_timeout_s=opts.start_timeout_s,
            enforce_eager=opts.enforce_eager, max_model_len=opts.max_model_len, kv_cache_gib=opts.kv_cache_gib,
            cpu_threads_bind=opts.cpu_threads_bind, log_path=Path(opts.log) if opts.log else None,
            prefix_caching=opts.prefix_caching,
        ),
        tls=config.tls.node_cert() if config.tls is not None else None,
    )  # fmt: skip

    def engine_died(returncode: int) -> None:
        # A region without its engine serves nothing: exit at once (callers in flight get
        # UNAVAILABLE, heartbeats stop) with a status its launcher sees as a failure.
        log.error("region %s: its vLLM server exited with %d; the region exits", config.name, returncode)
        logging.shutdown()
        os._exit(3)

    engine.device_choice = choice
    engine.on_exit(engine_died)
    if opts.prefix_caching:
        from prfaas.engine.prefix_cache import ResidencyMirror

        block_bytes = config.prefix_block_tokens * engine.facts.kv_bytes_per_token
        capacity_blocks = int(opts.kv_cache_gib * 2**30) // block_bytes
        engine.prefix_cache = ResidencyMirror(config.prefix_block_tokens, capacity_blocks, MAX_PREFIX_BLOCKS)
    return engine
