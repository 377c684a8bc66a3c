"""Device selection on a host with or without GPUs, the bounded host-buffer pool, and the event-driven layer
copy out of device memory and the upload into it, driven through a fake device (tests/fake_device.py: a copy
engine thread that lands each copy later, as a side CUDA stream does): the forward only enqueues copies, the
sender waits on each layer's event, an upload hands its tensors over once its last copy landed, the buffers
are bounded, reused and all given back."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch
from fake_device import FakeDevice

from prfaas.engine.device import DeviceUnavailable, select_device
from prfaas.engine.staging import HostPool, LayerCopier, PoolExhausted, StagedShipment, size_class
from prfaas.engine.upload import LayerUploader


class FakeCuda:
    def __init__(self, gpus: int) -> None:
        self.gpus = gpus

    def is_available(self) -> bool:
        return self.gpus > 0

    def device_count(self) -> int:
        return self.gpus

    def get_device_name(self, device: int) -> str:
        return f"Fake GPU {device}"


def test_auto_picks_cuda_when_torch_sees_a_gpu_and_bf16_with_it() -> None:
    on_gpu = select_device("auto", "auto", FakeCuda(2))
    assert (on_gpu.device, on_gpu.dtype, on_gpu.name, on_gpu.is_cuda) == ("cuda:0", "bfloat16", "Fake GPU 0", True)
    on_cpu = select_device("auto", "auto", FakeCuda(0))
    assert (on_cpu.device, on_cpu.dtype, on_cpu.is_cuda) == ("cpu", "float32", False)
    assert "no CUDA" in on_cpu.reason
    assert select_device("auto", "float16", FakeCuda(1)).dtype == "float16"  # an explicit dtype stays
    assert select_device("cuda:1", "auto", FakeCuda(2)).device == "cuda:1"
    assert select_device("cuda", "auto", FakeCuda(1)).device == "cuda:0"
    assert select_device().device in ("cpu", "cuda:0")  # this host, through torch itself


def test_a_device_the_host_lacks_is_refused_with_the_reason() -> None:
    with pytest.raises(DeviceUnavailable, match="torch sees no CUDA device"):
        select_device("cuda", "auto", FakeCuda(0))
    with pytest.raises(DeviceUnavailable, match="has 2 GPU"):
        select_device("cuda:2", "auto", FakeCuda(2))
    for bad in ("gpu", "cuda:x", "tpu:0"):
        with pytest.raises(ValueError, match="device"):
            select_device(bad, "auto", FakeCuda(1))
    with pytest.raises(ValueError, match="dtype"):
        select_device("cpu", "int8", FakeCuda(0))


def test_the_pool_is_bounded_reuses_its_buffers_and_refuses_what_never_fits() -> None:
    made: list[int] = []

    def allocate(n: int) -> torch.Tensor:
        made.append(n)
        return torch.empty(n, dtype=torch.uint8)

    pool = HostPool(4 * size_class(100_000), pinned=False, allocate=allocate)
    held = [pool.acquire(100_000, 1.0) for _ in range(4)]
    assert pool.in_use_bytes == pool.allocated_bytes == 4 * size_class(100_000) <= pool.max_bytes
    with pytest.raises(PoolExhausted, match="came free"):
        pool.acquire(100_000, 0.05)  # at its bound: waits, then refuses
    threading.Timer(0.05, pool.release, args=(held.pop(),)).start()
    held.append(pool.acquire(90_000, 2.0))  # a release wakes the waiter, which reuses that buffer
    assert len(made) == 4 and pool.allocations == 4
    for buffer in held:
        pool.release(buffer)
    assert pool.in_use_bytes == 0
    small = pool.acquire(1000, 1.0)  # another size: idle buffers of the other size are freed to make room
    assert small.numel() == size_class(1000) and pool.allocated_bytes <= pool.max_bytes
    pool.release(small)
    with pytest.raises(ValueError, match="not handed out"):
        pool.release(small)
    with pytest.raises(ValueError, match="does not fit"):
        pool.acquire(pool.max_bytes + 1, 1.0)


class _Collecting:
    """Stands in for a transport Shipment: records the layers added and their bytes."""

    def __init__(self) -> None:
        self.added: dict[int, tuple[bytes, bytes]] = {}
        self.done = threading.Event()
        self.expected = 0

    def add_layer(self, index: int, k: memoryview, v: memoryview) -> None:
        self.added[index] = (bytes(k), bytes(v))
        if len(self.added) == self.expected:
            self.done.set()


def test_a_layer_copy_is_enqueued_without_waiting_and_the_sender_gets_its_bytes_after_its_event() -> None:
    device = FakeDevice(delay_s=0.1)
    copier = LayerCopier(device, HostPool(64 << 20, pinned=False))
    layers = [(torch.randn(2, 64, 16), torch.randn(2, 64, 16)) for _ in range(6)]
    shipment = _Collecting()
    shipment.expected = len(layers)
    staged = StagedShipment(copier, shipment, failed=lambda exc: pytest.fail(str(exc)))  # type: ignore[arg-type]
    began = time.monotonic()
    for index, (k, v) in enumerate(layers):  # the "forward": each layer's copy enqueued as it is done
        staged.put(index, k, v)
    enqueue_s = time.monotonic() - began
    assert enqueue_s < 0.1 * len(layers) / 2, enqueue_s  # not waiting on the copies (6 x 100 ms)
    assert device.copies < len(layers)  # the forward ended before the copies did
    assert shipment.done.wait(5)
    for index, (k, v) in enumerate(layers):  # each layer's bytes, in host memory, as the device held them
        assert shipment.added[index] == (k.numpy().tobytes(), v.numpy().tobytes())
    landed = [layer.landed_at - layer.staged_at for layer in staged.layers if layer.landed_at is not None]
    assert len(landed) == len(layers) and min(landed) > 0  # layer end -> bytes in host memory, each measured
    staged.end()
    assert copier.pool.in_use_bytes == 0


def test_a_thousand_shipments_reuse_the_same_buffers_and_leak_none() -> None:
    device = FakeDevice(delay_s=0.0)
    pool = HostPool(16 << 20, pinned=False)
    copier = LayerCopier(device, pool)
    k = torch.randn(2, 128, 16)
    for _ in range(1000):
        shipment = _Collecting()
        shipment.expected = 4
        staged = StagedShipment(copier, shipment, failed=lambda exc: pytest.fail(str(exc)))  # type: ignore[arg-type]
        for index in range(4):
            staged.put(index, k, k)
        assert shipment.done.wait(5)
        staged.end()
    assert pool.in_use_bytes == 0
    assert pool.allocations == 8 and pool.acquires == 8000  # 4 layers x K and V, made once, reused after
    assert pool.high_water_bytes == 8 * size_class(k.numel() * 4) <= pool.max_bytes


def test_a_copy_that_never_lands_fails_the_shipment_and_its_buffers_are_not_reused() -> None:
    class Stuck(FakeDevice):
        def copy_after(self, stream: Any, event: Any, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
            return threading.Event()  # never set

    pool = HostPool(8 << 20, pinned=False)
    errors: list[BaseException] = []
    staged = StagedShipment(LayerCopier(Stuck(), pool), _Collecting(), failed=errors.append, timeout_s=0.1)  # type: ignore[arg-type]
    staged.put(0, torch.zeros(4, 4), torch.zeros(4, 4))
    deadline = time.monotonic() + 5
    while not errors and time.monotonic() < deadline:
        time.sleep(0.01)
    assert errors and isinstance(errors[0], TimeoutError) and "did not finish" in str(errors[0])
    staged.end()
    assert pool.in_use_bytes > 0  # held back: a late copy could still write into it


def test_a_copy_that_fails_to_enqueue_raises_and_its_buffers_leave_the_pool_unreused() -> None:
    class Broken(FakeDevice):
        def copy_after(self, stream: Any, event: Any, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    pool = HostPool(1 << 20, pinned=False)
    copier = LayerCopier(Broken(), pool)
    for _ in range(3):  # each try would otherwise hold 2 x 256 KiB of the 1 MiB pool for good
        with pytest.raises(RuntimeError, match="illegal memory access"):
            copier.stage(0, torch.zeros(2, 512, 64), torch.zeros(2, 512, 64))
    # dropped, not released: a copy enqueued before the error may still write them
    assert pool.in_use_bytes == 0 and pool.allocated_bytes == 0
    assert pool.acquire(256 << 10, 0.1) is not None


def test_an_upload_enqueues_each_layer_and_its_tensors_hold_the_bytes_once_finished() -> None:
    device = FakeDevice(delay_s=0.05)
    pool = HostPool(64 << 20, pinned=False)
    upload = LayerUploader(device, pool, torch.device("cpu")).begin(timeout_s=5)
    layers = [torch.randn(2, 64, 16).to(torch.bfloat16) for _ in range(6)]
    received = [bytearray(layer.view(torch.uint8).numpy().tobytes()) for layer in layers]  # the transport's buffers
    began = time.monotonic()
    tensors = []
    for raw in received:
        tensors.append(upload.put(raw, (2, 64, 16), torch.bfloat16))
        raw[:] = bytes(len(raw))  # the transport reuses its buffer at once: the upload copied it out
    assert time.monotonic() - began < 0.05 * len(layers) / 2  # not waiting on the copies (6 x 50 ms)
    assert device.copies < len(layers)
    upload.finish()
    assert device.copies == len(layers)
    assert all(torch.equal(t, layer) for t, layer in zip(tensors, layers, strict=True))
    assert pool.in_use_bytes == 0 and upload.uploaded_bytes == sum(len(r) for r in received)
    with pytest.raises(ValueError, match="do not fill"):
        upload.put(bytes(10), (2, 64, 16), torch.bfloat16)
    assert pool.in_use_bytes == 0


def test_an_upload_larger_than_the_pool_reuses_its_own_landed_buffers_and_a_thousand_leak_none() -> None:
    device = FakeDevice(delay_s=0.0)
    layer = torch.randn(2, 128, 16)  # 16 KiB: one 64 KiB size class a part
    pool = HostPool(2 * size_class(layer.numel() * 4), pinned=False)  # two parts' worth, a shipment has 16
    uploader = LayerUploader(device, pool, torch.device("cpu"))
    raw = layer.numpy().tobytes()
    for _ in range(1000):
        upload = uploader.begin(timeout_s=5)
        tensors = [upload.put(raw, (2, 128, 16), torch.float32) for _ in range(16)]
        upload.finish()
        assert torch.equal(tensors[-1], layer)
    assert pool.in_use_bytes == 0 and pool.allocations <= 2 and pool.high_water_bytes <= pool.max_bytes


def test_an_upload_whose_copy_never_lands_times_out_and_its_buffer_is_not_reused() -> None:
    class Stuck(FakeDevice):
        def copy_after(self, stream: Any, event: Any, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
            return threading.Event()  # never set

    pool = HostPool(8 << 20, pinned=False)
    upload = LayerUploader(Stuck(), pool, torch.device("cpu")).begin(timeout_s=0.1)
    upload.put(bytes(64), (4, 4), torch.float32)
    with pytest.raises(TimeoutError, match="did not finish"):
        upload.finish()
    upload.close()
    assert pool.in_use_bytes > 0  # held back: a late copy could still read it


def test_a_shipment_past_the_pool_copies_its_other_layers_synchronously_and_completes() -> None:
    device = FakeDevice(delay_s=0.05)
    layer = torch.randn(2, 128, 16)
    pool = HostPool(2 * size_class(layer.numel() * 4), pinned=False)  # one layer's K and V
    copier = LayerCopier(device, pool)
    layers = [(layer + i, layer - i) for i in range(5)]
    shipment = _Collecting()
    shipment.expected = len(layers)
    staged = StagedShipment(copier, shipment, failed=lambda exc: pytest.fail(str(exc)))  # type: ignore[arg-type]
    for index, (k, v) in enumerate(layers):
        staged.put(index, k, v)  # the first takes the pool; the rest do not wait for it
    assert copier.unpinned_layers == len(layers) - 1
    assert shipment.done.wait(5)
    for index, (k, v) in enumerate(layers):
        assert shipment.added[index] == (k.numpy().tobytes(), v.numpy().tobytes())
    staged.end()
    assert pool.in_use_bytes == 0 and pool.allocations == 2


def test_the_buffers_of_a_transfer_that_did_not_complete_are_dropped_not_reused() -> None:
    pool = HostPool(8 << 20, pinned=False)
    copier = LayerCopier(FakeDevice(delay_s=0.0), pool)
    shipment = _Collecting()
    shipment.expected = 2
    staged = StagedShipment(copier, shipment, failed=lambda exc: pytest.fail(str(exc)))  # type: ignore[arg-type]
    for index in range(2):
        staged.put(index, torch.zeros(4, 64), torch.zeros(4, 64))
    assert shipment.done.wait(5)
    held = [bytes(shipment.added[0][0])]  # an encoder of the canceled transfer could still hold a view
    staged.end(reuse=False)
    assert pool.in_use_bytes == 0 and pool.allocated_bytes == 0  # out of the pool: the next shipment makes new
    staged.end()  # idempotent
    assert held and pool.acquire(1000, 1.0) is not None and pool.allocations == 5


def test_an_upload_waits_for_the_compute_queued_before_it() -> None:
    """The device memory an upload writes may have been freed by kernels still queued on the compute stream:
    its copy waits for them (an event on the compute stream), not only for its own bytes."""
    device = FakeDevice(delay_s=0.0, compute_s=0.2)
    upload = LayerUploader(device, HostPool(8 << 20, pinned=False), torch.device("cpu")).begin(timeout_s=5)
    began = time.monotonic()
    target = upload.put(torch.ones(4, 64).numpy().tobytes(), (4, 64), torch.float32)
    time.sleep(0.05)
    assert device.copies == 0  # the compute queued before it has not finished
    upload.finish()
    assert time.monotonic() - began >= 0.2 and torch.equal(target, torch.ones(4, 64))


def test_pinned_memory_the_driver_refuses_costs_no_room_and_the_layer_is_copied_synchronously() -> None:
    """`cudaHostAlloc` may fail (the host's pinned memory is exhausted): the pool counts nothing for it, so a
    later allocation still fits the bound, and the layer's copy falls back to a blocking one instead of
    failing the forward."""
    refusals = [True, True, True]

    def allocate(nbytes: int) -> torch.Tensor:
        if refusals:
            refusals.pop()
            raise RuntimeError("CUDA error: out of memory (pinned)")
        return torch.empty(nbytes, dtype=torch.uint8)

    pool = HostPool(4 << 20, pinned=False, allocate=allocate)
    for _ in range(3):
        with pytest.raises(RuntimeError):
            pool.acquire(1 << 20, 0.0)
    assert pool.allocated_bytes == 0
    pool.release(pool.acquire(2 << 20, 0.0))  # fits: the refused allocations took no room
    refusals.append(True)
    copier = LayerCopier(FakeDevice(), HostPool(4 << 20, pinned=False, allocate=allocate))
    k, v = torch.randn(2, 64, 16), torch.randn(2, 64, 16)
    layer = copier.stage(0, k, v)
    assert bytes(copier.host_bytes(layer, 5)[0]) == k.numpy().tobytes() and copier.unpinned_layers == 1
