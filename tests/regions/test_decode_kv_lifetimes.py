"""Nothing of a failed job's KV outlives its reservation: once the reservation ends (its bytes
back in the book) the tensors are gone too, though its outcome stays readable (the tombstone)
for minutes. Before, the tombstone kept the error itself, whose traceback kept the frames it
passed alive: the half-assembled layers (device memory on a GPU), the engine's cache."""

from __future__ import annotations

import gc
import threading
import time
import types
import uuid
import weakref
from collections.abc import Iterator

import grpc
import torch
from decode_kit import Context, ScriptedBackend, decode_request, drain, reserve_request, status
from region_kit import wait_until

from prfaas.decode_region.agent import DecodeAgent
from prfaas.decode_region.assembly import LayoutCheck
from prfaas.decode_region.backend import Expected, KVHold, ShipmentEvents
from prfaas.decode_region.hf_backend import Assembly
from prfaas.engine.errors import EngineUnavailable
from prfaas.engine.sampling import Chosen
from prfaas.transport.errors import PeerUnavailable
from prfaas.transport.open_info import OpenInfo

NUM_LAYERS, SHAPE = 8, (2, 333, 16)  # [kv_heads, tokens, head_dim]: a shape no other tensor here has
LAYOUT = LayoutCheck("float32", NUM_LAYERS, SHAPE[0], SHAPE[2])
INFO = OpenInfo("float32", (SHAPE,) * NUM_LAYERS, 0, 1 << 20)


def live_layers() -> int:
    """KV layer tensors (k or v) still alive anywhere in the process."""
    gc.collect()
    return sum(1 for o in gc.get_objects() if type(o) is torch.Tensor and tuple(o.shape) == SHAPE)


class BrokenInbound:
    """A shipment whose sender goes away after `num_layers` layers."""

    info = INFO
    ticket = types.SimpleNamespace(tenant="acme")

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self.buf = bytes(SHAPE[0] * SHAPE[1] * SHAPE[2] * 4)

    def layer(self, index: int, timeout_s: float) -> tuple[bytes, bytes]:
        if index >= self.num_layers:
            raise PeerUnavailable("the prefill region went away mid-shipment")  # UNAVAILABLE: logged without traceback
        return self.buf, self.buf

    def cancel(self, reason: str) -> None:
        pass

    def release(self) -> None:
        pass


def expected(kv_bytes: int = INFO.raw_bytes) -> Expected:
    now = time.monotonic()
    return Expected(str(uuid.uuid4()), 1, "acme", kv_bytes, now + 30, now)


class AssemblingBackend(ScriptedBackend):
    """Holds are the HF backend's `Assembly` of a shipment that breaks after 6 of its 8 layers."""

    def expect(self, expected: Expected, ttl_s: float, events: ShipmentEvents) -> KVHold:
        return Assembly(expected, BrokenInbound(6), LAYOUT, events)  # type: ignore[arg-type]


def test_a_broken_shipment_leaves_no_layers_alive_once_its_reservation_ended() -> None:
    agent = DecodeAgent(AssemblingBackend(), kv_buffer_bytes=1 << 30)
    try:
        job_id = str(uuid.uuid4())
        agent.Reserve(reserve_request(job_id, kv_bytes=INFO.raw_bytes), Context())
        wait_until(agent.idle, 10.0)  # the shipment broke: the reservation ended
        for thread in threading.enumerate():
            if thread.name.startswith("prfaas-assemble-"):
                thread.join(10.0)
        assert agent.book.used_bytes == 0
        assert live_layers() == 0  # 12 before (6 layers' k and v), kept by the tombstone's traceback
        # the outcome is still what a late Decode gets
        code, details = status(lambda: list(agent.Decode(decode_request(job_id), Context())))
        assert code == grpc.StatusCode.UNAVAILABLE and "went away mid-shipment" in details
    finally:
        agent.close()


def test_an_assembly_drops_its_layers_before_it_reports_the_failure() -> None:
    """The reservation's bytes are freed when the failure is reported: the layers must be gone by then,
    whoever keeps the error (a log record, a tombstone)."""

    class Kept:
        def __init__(self) -> None:
            self.errors: list[BaseException] = []
            self.alive_when_reported = -1
            self.reported = threading.Event()

        def arrived(self, trace: str = "") -> None:
            raise AssertionError("the shipment cannot have arrived")

        def failed(self, error: BaseException) -> None:
            self.errors.append(error)  # kept, as long as the test runs
            self.alive_when_reported = live_layers()
            self.reported.set()

    events = Kept()
    assembly = Assembly(expected(), BrokenInbound(6), LAYOUT, events)  # type: ignore[arg-type]
    assembly.start()
    assert events.reported.wait(10.0)
    assert isinstance(events.errors[0], PeerUnavailable)
    assert events.alive_when_reported == 0  # 12 before: held by the error's traceback (assemble's `layers`)
    assert live_layers() == 0


def test_an_engine_failure_mid_decode_leaves_no_engine_cache_alive() -> None:
    caches: list[weakref.ref[torch.Tensor]] = []

    def failing(canceled: threading.Event) -> Iterator[Chosen]:
        cache = torch.zeros(1 << 16)  # stands for the engine's KV cache, live while it decodes
        caches.append(weakref.ref(cache))
        yield Chosen(5)
        raise EngineUnavailable("the engine's server went away")  # UNAVAILABLE: logged without traceback

    backend = ScriptedBackend(failing)
    agent = DecodeAgent(backend, kv_buffer_bytes=1000)
    try:
        job_id = str(uuid.uuid4())
        agent.Reserve(reserve_request(job_id), Context())
        backend.holds[0].arrive()
        num_events, code, _details = drain(agent.Decode(decode_request(job_id), Context()))
        assert (num_events, code) == (2, grpc.StatusCode.UNAVAILABLE)
        assert agent.book.used_bytes == 0
        gc.collect()
        assert caches and caches[0]() is None  # kept before, by the tombstone's traceback
        again = drain(agent.Decode(decode_request(job_id), Context()))  # the tombstone still says why
        assert again[1] == grpc.StatusCode.UNAVAILABLE and "went away" in again[2]
    finally:
        agent.close()


def test_a_reserve_that_fails_after_booking_gives_everything_back() -> None:
    """The watch on the prefill region can fail to open (its TLS files unreadable since the region
    started): the bytes go back at once and the backend's hold is ended, never started. Before, the
    bytes stayed booked until the reservation's TTL and the receiver kept expecting the shipment."""
    backend = ScriptedBackend()
    agent = DecodeAgent(backend, kv_buffer_bytes=1000)

    def unreadable(*_args: object, **_kwargs: object) -> object:
        raise ValueError("ca: cannot read /etc/prfaas/ca.pem: No such file or directory")

    agent.watcher.watch = unreadable  # type: ignore[method-assign]
    try:
        code, _details = status(
            lambda: agent.Reserve(reserve_request(str(uuid.uuid4()), 400, prefill_grpc="10.0.0.9:7000"), Context())
        )
        assert code == grpc.StatusCode.INTERNAL
        assert agent.book.used_bytes == 0 and agent.idle()
        assert backend.holds[0].ended is not None and not backend.holds[0].started
        reply = agent.Reserve(reserve_request(str(uuid.uuid4()), 1000), Context())  # all of it is free
        assert reply.free_bytes == 0
    finally:
        agent.close()


def test_a_reserve_whose_hold_cannot_start_gives_everything_back() -> None:
    backend = ScriptedBackend()
    agent = DecodeAgent(backend, kv_buffer_bytes=1000)
    original = backend.expect

    def unstartable(*args: object) -> KVHold:
        hold = original(*args)  # type: ignore[arg-type]

        def start() -> None:
            raise RuntimeError("can't start new thread")  # Assembly.start's thread, past the process's limit

        hold.start = start  # type: ignore[method-assign]
        return hold

    backend.expect = unstartable  # type: ignore[method-assign]
    try:
        code, _details = status(lambda: agent.Reserve(reserve_request(str(uuid.uuid4()), 400), Context()))
        assert code == grpc.StatusCode.INTERNAL
        assert agent.book.used_bytes == 0 and agent.idle() and backend.holds[0].ended is not None
    finally:
        agent.close()
