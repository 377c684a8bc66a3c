"""One region process, from its config to its end (`prfaas region --config FILE`): build it,
start serving, heartbeat to the registry, print the `ready ...` line launchers wait for
(devstack/processes.py reads it), then serve until SIGTERM (drain: running work finishes
within `drain_timeout_s`) or SIGINT (stop at once)."""

from __future__ import annotations

import math
import os
import signal
import sys
import threading
from collections.abc import Mapping

from prfaas.region.build import RoleBuilder, build_region
from prfaas.region.config import RegionConfig
from prfaas.telemetry import tracing

GIL_SWITCH_S = 0.0005  # default of PRFAAS_GIL_SWITCH_S
MAX_GIL_SWITCH_S = 0.1  # past it a thread may hold the GIL long enough to stall heartbeats and health checks


def gil_switch_s(environ: Mapping[str, str] = os.environ) -> float:
    """The GIL switch interval (seconds) PRFAAS_GIL_SWITCH_S asks for, else GIL_SWITCH_S; ValueError naming
    the variable when it is not a number in (0, MAX_GIL_SWITCH_S]."""
    text = environ.get("PRFAAS_GIL_SWITCH_S")
    if text is None:
        return GIL_SWITCH_S
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value <= MAX_GIL_SWITCH_S:  # NaN fails too
        raise ValueError(f"PRFAAS_GIL_SWITCH_S must be a number in (0, {MAX_GIL_SWITCH_S:g}]: {text!r}")
    return value


def serve(config: RegionConfig, roles: Mapping[str, RoleBuilder]) -> None:
    """`roles`: the builder of each role ("prefill", "decode"). Raises EngineError, OSError
    or ValueError when the region cannot start."""
    # KV transport threads share the GIL with the forward: a short switch interval keeps the
    # layer-wise shipment from stalling the prefill (measured in bench/split_ttft.py).
    sys.setswitchinterval(gil_switch_s())  # before the engine loads: a bad value exits at once
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
