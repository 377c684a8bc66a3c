"""KV out of device memory without stalling the forward.

On a GPU each layer's K and V are copied to host buffers as soon as the layer has written them: the layer's
end is an event recorded on the compute stream, a side stream waits on that event (not on the forward) and
copies into pinned host buffers, and records a second event; the sender waits on that one and then hands the
host bytes to the shipment (`LayerCopier.stage`, `LayerCopier.host_bytes`). The forward only enqueues work,
so the next layer computes while the last one crosses PCIe. Host buffers come from a bounded pool of pinned
memory (`HostPool`): reused across shipments after a completed transfer, never more than `max_bytes`
allocated; a layer that finds no buffer free is copied synchronously instead (the forward waits for it, the
shipment goes on); a waiter on the pool (the decode side) gets `PoolExhausted` at its deadline.

The GPU-specific calls sit behind `DeviceOps` (`CudaOps` on CUDA), so tests drive the same logic with a
fake device. On the CPU nothing of this runs: a CPU tensor's bytes are already in host memory
(engine/kv.py `byte_view`).

The decode side runs the same path the other way: engine/upload.py."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from prfaas.engine.kv import byte_view
from prfaas.transport.api import Shipment

log = logging.getLogger(__name__)
MIN_BUFFER_BYTES = 64 << 10  # buffers come in powers of two from this size up: a few sizes serve every layer


class PoolExhausted(RuntimeError):
    """No host buffer of that size came free before the deadline (every one is held by shipments in flight)."""


def size_class(nbytes: int) -> int:
    """The buffer size that serves `nbytes`: the next power of two, at least MIN_BUFFER_BYTES."""
    return max(MIN_BUFFER_BYTES, 1 << max(0, nbytes - 1).bit_length())


class HostPool:
    """Host buffers (uint8 tensors, pinned when `pinned`) handed out by size class, bounded by `max_bytes`
    allocated in all. Thread-safe. `allocate(nbytes)` makes a new buffer (tests count them)."""

    def __init__(self, max_bytes: int, *, pinned: bool, allocate: Any = None) -> None:
        if max_bytes < MIN_BUFFER_BYTES:
            raise ValueError(f"max_bytes must be at least {MIN_BUFFER_BYTES}, got {max_bytes}")
        self.max_bytes = max_bytes
        self.pinned = pinned
        self._allocate = allocate or (lambda n: torch.empty(n, dtype=torch.uint8, pin_memory=pinned))
        self._free: dict[int, list[torch.Tensor]] = defaultdict(list)
        self._out: dict[int, int] = {}  # id of a buffer handed out -> its size class
        self._cond = threading.Condition()
        self.allocated_bytes = 0
        self.allocations = 0  # buffers made (the rest of the acquires reused one)
        self.acquires = 0
        self.high_water_bytes = 0  # most bytes handed out at once

    @property
    def in_use_bytes(self) -> int:
        with self._cond:
            return self._in_use()

    def _in_use(self) -> int:
        return sum(self._out.values())

    def acquire(self, nbytes: int, timeout_s: float) -> torch.Tensor:
        """A buffer of at least `nbytes` (a view of exactly `nbytes`); waits up to `timeout_s` for one to come
        free when the pool is at its bound. Raises PoolExhausted, or ValueError for more than the bound."""
        size = size_class(nbytes)
        if size > self.max_bytes:
            raise ValueError(f"a {nbytes}-byte layer part does not fit a host pool of {self.max_bytes} bytes")
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                buffer = self._take(size)
                if buffer is not None:
                    self._out[id(buffer)] = size
                    self.acquires += 1
                    self.high_water_bytes = max(self.high_water_bytes, self._in_use())
                    return buffer
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise PoolExhausted(f"no {size}-byte host buffer came free within {timeout_s:g} s "
                                        f"({self._in_use()} of {self.max_bytes} bytes held by shipments)")  # fmt: skip
                self._cond.wait(remaining)

    def _take(self, size: int) -> torch.Tensor | None:
        """A free buffer of `size`, a new one within the bound, or None; frees idle buffers of other sizes to
        make room. Called with the lock held."""
        if self._free[size]:
            return self._free[size].pop()
        idle_bytes = sum(other * len(idle) for other, idle in self._free.items())
        if self.allocated_bytes - idle_bytes + size > self.max_bytes:
            return None  # evicting every idle buffer would not make room: keep them for their own sizes
        evicted = False
        for other, idle in self._free.items():
            while idle and self.allocated_bytes + size > self.max_bytes:
                idle.pop()
                self.allocated_bytes -= other
                evicted = True
        if evicted and self.pinned:  # torch caches freed pinned blocks: give them back, or the bound is not one
            _empty_host_cache()
        if self.allocated_bytes + size > self.max_bytes:
            return None
        buffer = self._allocate(size)  # may raise (pinned memory refused): then nothing is counted
        self.allocated_bytes += size
        self.allocations += 1
        return buffer

    def release(self, buffer: torch.Tensor) -> None:
        """Give `buffer` (as `acquire` returned it) back. Raises ValueError for a buffer not handed out."""
        with self._cond:
            size = self._out.pop(id(buffer), None)
            if size is None:
                raise ValueError("this buffer was not handed out by this pool (or was released already)")
            self._free[size].append(buffer)
            self._cond.notify_all()

    def discard(self, buffer: torch.Tensor) -> None:
        """Forget a handed-out buffer without reusing it (something may still read it: a transfer that ended
        early); its room in the bound comes free now, its memory when the last reference to it goes."""
        with self._cond:
            size = self._out.pop(id(buffer), None)
            if size is None:
                raise ValueError("this buffer was not handed out by this pool (or was released already)")
            self.allocated_bytes -= size
            self._cond.notify_all()


def compute_done(tensor: torch.Tensor | None) -> tuple[Any, torch.device] | None:
    """For a CUDA `tensor`: an event recorded now on the calling thread's current stream (what it computed
    so far), and the device, for another thread to wait on; None on the CPU (nothing is queued there)."""
    if tensor is None or not tensor.is_cuda:
        return None
    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
    event.record(torch.cuda.current_stream(tensor.device))
    return event, tensor.device


class DeviceOps(Protocol):
    """The device calls the layer copy makes (`CudaOps`; a fake device in tests)."""

    def side_stream(self) -> Any:
        """A stream of its own for the copies."""
        ...

    def layer_done(self) -> Any:
        """An event recorded now on the compute (current) stream: the layer's KV is written once it fires."""
        ...

    def copy_after(self, stream: Any, event: Any, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
        """On `stream`: wait for `event` (None: nothing to wait for), then copy the bytes of each (destination,
        source), one of them in host memory and the other in device memory; returns an event that fires when
        the copies are done. Returns at once."""
        ...

    def wait(self, event: Any, timeout_s: float) -> bool:
        """Block until `event` fired (True) or `timeout_s` passed (False)."""
        ...


class CudaOps:
    """`DeviceOps` on a CUDA device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def side_stream(self) -> Any:
        return torch.cuda.Stream(device=self.device)  # type: ignore[no-untyped-call]

    def layer_done(self) -> Any:
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(torch.cuda.current_stream(self.device))
        return event

    def copy_after(self, stream: Any, event: Any, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
        done = torch.cuda.Event()  # type: ignore[no-untyped-call]
        with torch.cuda.stream(stream):
            if event is not None:
                stream.wait_event(event)
            for destination, source in pairs:
                as_bytes(destination).copy_(as_bytes(source), non_blocking=True)
                for tensor in (destination, source):
                    if tensor.is_cuda:
                        tensor.record_stream(stream)  # the caching allocator keeps it until the copy is done
            done.record(stream)
        return done

    def wait(self, event: Any, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        pause = 0.0002
        while not event.query():  # synchronize() has no deadline: poll, backing off (a waiting sender must not
            if time.monotonic() > deadline:  # take the GIL from the forward's thread every 0.2 ms)
                return False
            time.sleep(pause)
            pause = min(0.002, pause * 2)
        return True


@dataclass
class StagedLayer:
    """One layer's K and V on their way to host memory (`LayerCopier.stage`)."""

    index: int
    nbytes: tuple[int, int]
    buffers: tuple[torch.Tensor, torch.Tensor]
    copied: Any  # the event that fires when both are in host memory; None: copied already (not pooled)
    pooled: bool = True  # the buffers are the pool's (else a synchronous copy's own host tensors)
    staged_at: float = field(default_factory=time.monotonic)  # when the layer was done (its copy enqueued)
    landed_at: float | None = None  # when the sender saw its bytes in host memory


class LayerCopier:
    """Stages layers out of device memory on one side stream, into `pool` buffers (module docstring)."""

    def __init__(self, ops: DeviceOps, pool: HostPool) -> None:
        self.ops = ops
        self.pool = pool
        self.stream = ops.side_stream()
        self.unpinned_layers = 0  # layers copied synchronously: no pinned buffer was free

    def stage(self, index: int, k: torch.Tensor, v: torch.Tensor) -> StagedLayer:
        """Enqueue layer `index`'s copy behind the compute done so far; returns without waiting for it. When
        the pool has no buffer free now (shipments in flight hold it all, or a part is larger than the whole
        pool), the layer is copied synchronously into pageable memory instead: the forward waits for that
        layer's copy, as it did without a side stream, and the shipment goes on."""
        k, v = k.contiguous(), v.contiguous()  # before the event: a copy made here is compute to wait for
        event = self.ops.layer_done()
        sizes = (k.numel() * k.element_size(), v.numel() * v.element_size())
        buffers: list[torch.Tensor] = []
        try:
            for size in sizes:
                buffers.append(self.pool.acquire(size, 0.0))
        except (PoolExhausted, ValueError, RuntimeError):  # RuntimeError: the driver refused pinned memory
            for buffer in buffers:
                self.pool.release(buffer)
            return self._copied_now(index, k, v, sizes)
        kb, vb = buffers
        pairs = [(kb[: sizes[0]], k), (vb[: sizes[1]], v)]
        try:
            copied = self.ops.copy_after(self.stream, event, pairs)
        except BaseException:  # the K copy may be enqueued already and write its buffer later: never reuse them
            for buffer in buffers:
                self.pool.discard(buffer)
            raise
        return StagedLayer(index, sizes, (kb, vb), copied)

    def _copied_now(self, index: int, k: torch.Tensor, v: torch.Tensor, sizes: tuple[int, int]) -> StagedLayer:
        self.unpinned_layers += 1
        if self.unpinned_layers == 1 or self.unpinned_layers % 1000 == 0:
            log.warning("no pinned host buffer free (%d of %d bytes held by shipments): layer copies block the "
                        "forward (%d so far); raise staging_bytes", self.pool.in_use_bytes, self.pool.max_bytes,
                        self.unpinned_layers)  # fmt: skip
        return StagedLayer(index, sizes, (as_bytes(k.cpu()), as_bytes(v.cpu())), None, pooled=False)

    def host_bytes(self, layer: StagedLayer, timeout_s: float) -> tuple[memoryview, memoryview]:
        """Wait for `layer`'s copy (its event, not the forward), then its K and V bytes in host memory.
        Raises TimeoutError when the copy has not landed within `timeout_s`."""
        if layer.copied is not None and not self.ops.wait(layer.copied, timeout_s):
            raise TimeoutError(f"layer {layer.index}'s device-to-host copy did not finish within {timeout_s:g} s")
        layer.landed_at = time.monotonic()
        (kb, vb), (kn, vn) = layer.buffers, layer.nbytes
        return _view(kb[:kn]), _view(vb[:vn])

    def release(self, layer: StagedLayer) -> None:
        """Give the layer's host buffers back (once its bytes are encoded, or its shipment ended)."""
        for buffer in layer.buffers if layer.pooled else ():
            self.pool.release(buffer)

    def discard(self, layer: StagedLayer) -> None:
        """Drop the layer's host buffers from the pool without reusing them (a transfer that ended early may
        still be reading them)."""
        for buffer in layer.buffers if layer.pooled else ():
            self.pool.discard(buffer)


class StagedShipment:
    """A shipment fed from staged layers: a thread of its own waits on each layer's copy, in the order they
    were staged, and adds its host bytes to `shipment`; every buffer goes back to the pool once `end()` is
    called (the transfer completed: its bytes were encoded and sent), or is dropped from it (`reuse=False`:
    the transfer ended otherwise, and an encoder or sender may still read a buffer). `failed(error)` is told when a copy
    does not land; the shipment is then missing that layer and its transfer is the caller's to cancel."""

    def __init__(self, copier: LayerCopier, shipment: Shipment, failed: Callable[[BaseException], None],
                 timeout_s: float = 30.0) -> None:  # fmt: skip
        self.copier = copier
        self.shipment = shipment
        self.failed = failed
        self.timeout_s = timeout_s
        self.layers: list[StagedLayer] = []  # staged so far, each released once by `end`
        self._queue: queue.Queue[StagedLayer | None] = queue.Queue()
        self._lock = threading.Lock()
        self._ended = False
        self._reuse = True
        self._thread = threading.Thread(target=self._feed, name="prfaas-kv-stager", daemon=True)
        self._thread.start()

    def put(self, index: int, k: torch.Tensor, v: torch.Tensor) -> StagedLayer:
        """Stage layer `index` (returns once its copy is enqueued: the forward goes on)."""
        layer = self.copier.stage(index, k, v)
        with self._lock:
            ended = self._ended
            if not ended:
                self.layers.append(layer)
        if ended:  # the transfer ended meanwhile: nothing will read it; its buffers back once the copy landed
            self._give_back(layer, self._reuse)
        else:
            self._queue.put(layer)
        return layer

    def _feed(self) -> None:
        while (layer := self._queue.get()) is not None:
            try:
                k, v = self.copier.host_bytes(layer, self.timeout_s)
                with self._lock:
                    if self._ended:
                        continue
                self.shipment.add_layer(layer.index, k, v)
            except Exception as exc:  # a copy that never landed, or a shipment that refuses the layer
                self.failed(exc)

    def end(self, reuse: bool = True) -> None:
        """The transfer ended: stop feeding and give every buffer back, or drop it from the pool when the
        transfer did not complete (`reuse=False`). Idempotent."""
        with self._lock:
            if self._ended:
                return
            self._ended = True
            self._reuse = reuse
            layers, self.layers = self.layers, []
        self._queue.put(None)
        self._thread.join(self.timeout_s)
        for layer in layers:
            self._give_back(layer, reuse)

    def _give_back(self, layer: StagedLayer, reuse: bool) -> None:
        """The layer's buffers back to the pool (or dropped from it), only once no copy can still land in them."""
        if layer.copied is None or self.copier.ops.wait(layer.copied, self.timeout_s):
            (self.copier.release if reuse else self.copier.discard)(layer)
        else:
            log.error("layer %d's device-to-host copy never finished: its host buffers are not reused",
                      layer.index)  # fmt: skip


def feed_layer(shipment: Shipment, staged: StagedShipment | None, index: int, k: torch.Tensor,
               v: torch.Tensor) -> None:  # fmt: skip
    """Add layer `index` to `shipment`: its bytes at once (a CPU tensor), or staged out of device memory."""
    if staged is None:
        shipment.add_layer(index, byte_view(k), byte_view(v))
    else:
        staged.put(index, k, v)


def device_copier(device: torch.device, max_bytes: int) -> LayerCopier | None:
    """The layer copier of an engine on `device` (a pinned pool of `max_bytes`); None on the CPU, whose
    tensors are host memory already."""
    if device.type != "cuda":
        return None
    return LayerCopier(CudaOps(device), HostPool(max_bytes, pinned=True))


def _empty_host_cache() -> None:
    """Return the pinned blocks torch's host allocator caches to the system (CUDA builds of torch)."""
    empty = getattr(torch._C, "_host_emptyCache", None)
    if empty is not None:
        empty()


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's storage as a flat uint8 tensor (a view: no copy)."""
    return tensor.reshape(-1).view(torch.uint8)


def _view(buffer: torch.Tensor) -> memoryview:
    array: Any = buffer.numpy()
    return memoryview(array).cast("B")
