"""Where a region's engine runs, and in which dtype: `device: auto` (the default) picks CUDA when torch sees a
GPU, else the CPU; `dtype: auto` is bfloat16 on a GPU and float32 on the CPU (bfloat16 flips near-tied
tokens against float32, so CPU figures compare engines in float32). An explicit choice the host cannot honour
(`cuda` without a GPU, `cuda:3` on a host with two) is refused at start with the reason, never silently
replaced. The choice is logged, printed on the region's `ready` line and exported as
`prfaas_region_device_info` (region/server.py)."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Protocol

import torch

from prfaas.engine.errors import EngineError

log = logging.getLogger(__name__)
DTYPES = ("float32", "bfloat16", "float16")


class DeviceUnavailable(EngineError):
    """The configured device is not on this host (no CUDA, or no GPU of that index)."""


class CudaProbe(Protocol):
    """What device selection asks of CUDA (torch.cuda; tests stand a fake host in for it)."""

    def is_available(self) -> bool: ...

    def device_count(self) -> int: ...

    def get_device_name(self, device: int) -> str: ...


@dataclass(frozen=True)
class DeviceChoice:
    """The device an engine runs on (`cpu`, `cuda:0`, ...), its dtype, the device's name, and why."""

    device: str
    dtype: str
    name: str
    reason: str

    @property
    def is_cuda(self) -> bool:
        return self.device.startswith("cuda")


def select_device(device: str = "auto", dtype: str = "auto", cuda: CudaProbe | None = None) -> DeviceChoice:
    """Resolve a region's `device` and `dtype` settings on this host (the module docstring). Raises
    DeviceUnavailable (an explicit device the host lacks) or ValueError (a setting that is neither)."""
    probe = cuda if cuda is not None else torch.cuda
    if dtype != "auto" and dtype not in DTYPES:
        raise ValueError(f"dtype must be auto or one of {', '.join(DTYPES)}, got {dtype!r}")
    if device == "auto":
        if probe.is_available() and probe.device_count() > 0:
            chosen, reason = "cuda:0", f"auto: CUDA sees {probe.device_count()} GPU(s)"
        else:
            chosen, reason = "cpu", "auto: torch sees no CUDA device"
    elif device == "cpu":
        chosen, reason = "cpu", "configured"
    elif device == "cuda" or device.startswith("cuda:"):
        index_text = device.partition(":")[2] or "0"
        if not index_text.isdigit():
            raise ValueError(f"device {device!r}: the GPU index must be a number (cuda:0)")
        if not probe.is_available():
            raise DeviceUnavailable(f"device {device!r} configured, but torch sees no CUDA device on this host "
                                    "(a CPU build of torch, no driver, or CUDA_VISIBLE_DEVICES empty); "
                                    "set device: auto or cpu")  # fmt: skip
        count = probe.device_count()
        if int(index_text) >= count:
            raise DeviceUnavailable(f"device {device!r} configured, but this host has {count} GPU(s)")
        chosen, reason = f"cuda:{int(index_text)}", "configured"
    else:
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {device!r}")
    on_gpu = chosen.startswith("cuda")
    resolved = dtype if dtype != "auto" else "bfloat16" if on_gpu else "float32"
    name = probe.get_device_name(int(chosen.partition(":")[2])) if on_gpu else f"cpu ({os.cpu_count()} cores)"
    choice = DeviceChoice(chosen, resolved, name, reason)
    log.info("engine on %s (%s), %s; %s", choice.device, choice.name, choice.dtype, choice.reason)
    return choice
