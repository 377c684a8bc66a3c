"""A region's stop (SIGTERM -> RegionServer.drain -> stop -> agent.close) is bounded even when a call into the
engine is stuck (a vLLM server alive but stalled): the agent waits for it a bounded while, then closes its
backend, which ends such calls (a vLLM server killed) and so frees them. Before, the prefill agent waited for
its workers with no bound before it closed the backend, and the decode agent ended each reservation's hold
(a vLLM server's `forget`) before it: neither ever closed. The engines are stand-ins whose calls block until
their backend closes, driven the way gRPC drives the agents (decode_kit's servicer context)."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from decode_kit import FACTS, Context, ScriptedBackend, ScriptedHold, drain, reserve_request

from prfaas.decode_region.agent import DecodeAgent
from prfaas.decode_region.backend import Expected, KVHold, ShipmentEvents
from prfaas.prefill_region.agent import PrefillAgent
from prfaas.prefill_region.backend import PrefillWork, Shipped
from prfaas.prefill_region.destination import Destination
from prfaas.protos.prfaas.v1 import common_pb2, prefill_pb2
from prfaas.region.errors import Unavailable

STUCK_S = 30.0  # how long a stuck call waits for its backend to close: past each test's own bound


def _closes_within(seconds: float, close: Callable[[], None]) -> float:
    """How long `close` took; it must return within `seconds` (run on a thread: one that hangs fails the test)."""
    started = time.monotonic()
    thread = threading.Thread(target=close, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"close() still blocked after {seconds} s"
    return time.monotonic() - started


class StuckPrefill:
    """A prefill backend whose forward blocks until the backend closes (a stalled vLLM server's call, which
    ends when the server is killed)."""

    facts = FACTS

    def __init__(self) -> None:
        self.running = threading.Event()
        self.closed = threading.Event()

    def admit(self, destination: Destination, params: Any) -> Destination:
        return destination

    def run(self, work: PrefillWork, job: Any) -> Shipped:
        self.running.set()
        self.closed.wait(STUCK_S)  # the job's cancel does not reach it
        raise Unavailable("the vLLM server exited")

    def reship(self, *args: Any) -> Any:
        raise NotImplementedError

    def drop(self, job_id: str, attempt: int = 0) -> bool:
        return False

    def path_reports(self) -> list[Any]:
        return []

    def close(self) -> None:
        self.closed.set()


def _prefill_request() -> prefill_pb2.PrefillRequest:
    return prefill_pb2.PrefillRequest(
        job_id=str(uuid.uuid4()), attempt=1, tenant="acme", token_ids=[1, 2, 3], timeout_s=60,
        sampling=common_pb2.SamplingParams(max_new_tokens=1),
        destination=prefill_pb2.Destination(kv_endpoint="127.0.0.1:9", ticket="ticket", codec="raw"),
    )  # fmt: skip


def test_prefill_close_with_a_worker_stuck_in_the_engine_closes_the_backend_and_returns() -> None:
    backend = StuckPrefill()
    agent = PrefillAgent(backend, num_workers=1)  # type: ignore[arg-type]
    ends: list[tuple[int, Any, str]] = []
    call = threading.Thread(target=lambda: ends.append(drain(agent.Prefill(_prefill_request(), Context()))))
    call.start()
    assert backend.running.wait(10.0)

    took = _closes_within(10.0, lambda: agent.close(wait_s=0.5))

    assert backend.closed.is_set()  # what frees the worker: closing the backend kills the server
    assert took < 5.0  # the stuck worker waited for 0.5 s, then the backend closed and it ended
    call.join(10.0)
    assert ends and ends[0][1].name == "UNAVAILABLE", ends  # "prefill region shutting down"
    assert agent.idle()


class StuckHold(ScriptedHold):
    """A hold whose end (a vLLM server's `forget`) blocks until its backend closes."""

    def __init__(self, closed: threading.Event) -> None:
        super().__init__()
        self.closed = closed

    def end(self, reason: str) -> None:
        self.closed.wait(STUCK_S)
        super().end(reason)


class StuckDecode(ScriptedBackend):
    def __init__(self) -> None:
        super().__init__()
        self.closed = threading.Event()

    def expect(self, expected: Expected, ttl_s: float, events: ShipmentEvents) -> KVHold:
        hold = StuckHold(self.closed)
        self.holds.append(hold)
        return hold

    def close(self) -> None:
        self.closed.set()


def test_decode_close_with_a_hold_stuck_in_the_engine_closes_the_backend_and_returns() -> None:
    backend = StuckDecode()
    agent = DecodeAgent(backend, kv_buffer_bytes=1000)
    agent.Reserve(reserve_request(str(uuid.uuid4())), Context())

    took = _closes_within(10.0, lambda: agent.close(wait_s=0.5))

    assert backend.closed.is_set()
    assert took < 5.0
    hold = backend.holds[0]
    assert hold.closed.is_set()
    deadline = time.monotonic() + 5.0
    while hold.ended is None and time.monotonic() < deadline:  # its end, freed by the close, finishes
        time.sleep(0.01)
    assert hold.ended is not None and "shutting down" in hold.ended
    assert agent.idle()
