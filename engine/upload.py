"""KV into device memory as it arrives: the decode side of engine/staging.py.

Each layer that lands in the transport's receive buffer is copied into a pinned buffer of a bounded pool
(`HostPool`: the transport reuses its own buffer at once) and from there into device memory on a side
stream, without waiting (`Upload.put`); the shipment is in device memory when its last layer's copy lands
(`Upload.finish`), not after a copy of the whole cache at the first decode step. The device calls go
through `DeviceOps` (`CudaOps` on CUDA, a fake device in tests). On the CPU nothing of this runs."""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import numpy as np
import torch

from prfaas.engine.staging import CudaOps, DeviceOps, HostPool, PoolExhausted

log = logging.getLogger(__name__)


class LayerUploader:
    """Uploads arriving layers into memory of `device` on one side stream, through `pool` buffers (module
    docstring); one `Upload` a shipment."""

    def __init__(self, ops: DeviceOps, pool: HostPool, device: torch.device) -> None:
        self.ops = ops
        self.pool = pool
        self.device = device
        self.stream = ops.side_stream()

    def begin(self, timeout_s: float = 30.0) -> Upload:
        return Upload(self, timeout_s)


class Upload:
    """One shipment's layers on their way into device memory. `put` returns a device tensor whose copy is in
    flight; `finish` waits for the last copy (the stream runs them in order), after which every tensor `put`
    returned holds its bytes, and gives the pinned buffers back; `close` (an abandoned shipment) gives back
    the buffers of the copies that landed. A shipment larger than the pool reuses the buffers of its own
    landed copies as it goes."""

    def __init__(self, uploader: LayerUploader, timeout_s: float) -> None:
        self.uploader = uploader
        self.timeout_s = timeout_s
        self._pending: list[tuple[torch.Tensor, Any]] = []  # (pinned buffer, its copy's event), oldest first
        self.uploaded_bytes = 0

    def put(self, data: bytes | bytearray | memoryview, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A tensor of `shape` and `dtype` in device memory that will hold `data` (its raw bytes, in host
        memory; copied out before this returns, so the caller may reuse it)."""
        source = np.frombuffer(data, dtype=np.uint8)
        if math.prod(shape) * dtype.itemsize != source.size:
            raise ValueError(f"{source.size} bytes do not fill a {list(shape)} {dtype} tensor")
        target = torch.empty(shape, dtype=dtype, device=self.uploader.device)  # before a buffer: it may be OOM
        buffer = self._buffer(source.size)
        try:
            view = buffer[: source.size]
            view.numpy()[:] = source
            # the side stream waits for what the compute stream queued so far: the allocator may have handed
            # out memory that queued kernels (another job's decode step) still use
            queued = self.uploader.ops.layer_done()
            event = self.uploader.ops.copy_after(self.uploader.stream, queued, [(target, view)])
        except BaseException:  # no copy was enqueued: nothing reads the buffer
            self.uploader.pool.release(buffer)
            raise
        self._pending.append((buffer, event))
        self.uploaded_bytes += source.size
        return target

    def _buffer(self, nbytes: int) -> torch.Tensor:
        """A pinned buffer: a free one, else one of this upload's own once its copy landed, else whatever the
        pool frees within the deadline (other shipments hold the rest)."""
        pool, ops = self.uploader.pool, self.uploader.ops
        while self._pending and ops.wait(self._pending[0][1], 0.0):  # landed: back to the pool, no waiting
            pool.release(self._pending.pop(0)[0])
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                return pool.acquire(nbytes, 0.0 if self._pending else max(0.0, deadline - time.monotonic()))
            except PoolExhausted:
                if not self._pending:
                    raise
            event = self._pending[0][1]  # the pool is at its bound and this upload holds part of it
            if not ops.wait(event, max(0.0, deadline - time.monotonic())):
                raise TimeoutError(f"a host-to-device copy did not finish within {self.timeout_s:g} s")
            pool.release(self._pending.pop(0)[0])

    def finish(self) -> None:
        """Wait for every copy (TimeoutError when they have not landed within the deadline), then give the
        buffers back."""
        if self._pending and not self.uploader.ops.wait(self._pending[-1][1], self.timeout_s):
            raise TimeoutError(f"the host-to-device copies did not finish within {self.timeout_s:g} s")
        self.close()

    def close(self) -> None:
        """Give back every buffer whose copy landed (waiting up to the deadline); one whose copy never landed
        stays out of the pool, as a late copy could still read it. Idempotent."""
        pending, self._pending = self._pending, []
        deadline = time.monotonic() + self.timeout_s
        for buffer, event in pending:
            if self.uploader.ops.wait(event, max(0.0, deadline - time.monotonic())):
                self.uploader.pool.release(buffer)
            else:
                log.error("a host-to-device copy never finished: its pinned buffer is not reused")


def device_uploader(device: torch.device, max_bytes: int) -> LayerUploader | None:
    """The layer uploader of a decode engine on `device` (a pinned pool of `max_bytes`); None on the CPU."""
    if device.type != "cuda":
        return None
    return LayerUploader(CudaOps(device), HostPool(max_bytes, pinned=True), device)
