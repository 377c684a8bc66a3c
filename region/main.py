"""One region process, from its config to its end (`prfaas region --config FILE`): build it,
start serving, heartbeat to the registry, print the `ready ...` line launchers wait for
(devstack/processes.py reads it), then serve until SIGTERM (drain: running work finishes
within `drain_timeout_s`) or SIGINT (stop at once)."""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Mapping

from prfaas.region.build import RoleBuilder, build_region
from prfaas.region.config import RegionConfig
from prfaas.telemetry import tracing

GIL_SWITCH_S = 0.0005  # default of PRFAAS_GIL_SWITCH_S


def serve(config: RegionConfig, roles: Mapping[str, RoleBuilder]) -> None:
    """`roles`: the builder of each role ("prefill", "decode"). Raises EngineError, OSError
    or ValueError when the region cannot start."""
    # KV transport threads share the GIL with the forward: a short switch interval keeps the
    # layer-wise shipment from stalling the prefill (measured in bench/split_ttft.py).
    sys.setswitchinterval(float(os.environ.get("PRFAAS_GIL_SWITCH_S", str(GIL_SWITCH_S))))
    tracing.configure(
        f"prfaas-region-{config.name}",
        {"prfaas.region": config.name, "prfaas.instance": config.instance, "prfaas.role": config.role},
    )
    server, registration = build_region(config, roles)
    heartbeat = None
    if config.control_plane_url:
        heartbeat = (config.control_plane_url, registration, config.heartbeat_interval_s)
    server.start(heartbeat)
    signal.signal(
        signal.SIGTERM, lambda *_: threading.Thread(target=server.drain, args=(config.drain_timeout_s,)).start()
    )
    signal.signal(signal.SIGINT, lambda *_: threading.Thread(target=server.stop).start())
    device = f"{server.device.device}/{server.device.dtype}" if server.device is not None else "-"
    print(f"ready region={config.name} instance={config.instance} role={config.role} grpc={server.grpc_address} "
          f"kv={registration.kv_endpoint or '-'} metrics={server.metrics_address or '-'} device={device}",
          flush=True)  # fmt: skip
    server.wait()
