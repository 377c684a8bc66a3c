"""A decode agent's calls made in this process, the way gRPC makes them (a servicer context
stand-in), on a scripted engine: for the agent's own rules (lifetimes, statuses, shutdown)
with no model, sockets or gRPC threads in the way."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import grpc

from prfaas.decode_region.backend import DecodeCall, Expected, Generated, KVHold, ShipmentEvents
from prfaas.engine.base import ModelFacts
from prfaas.engine.sampling import Chosen, SamplingParams
from prfaas.protos.prfaas.v1 import common_pb2, decode_pb2
from prfaas.region.errors import DeadlineExceeded

FACTS = ModelFacts("f" * 64, "float32", 1000, 2, 2, 4, 4096, frozenset({2}), eos_token_id=2)


class Aborted(Exception):
    """What `Context.abort` raises (gRPC's raises a bare Exception and ends the call with the status)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


class Context:
    """A servicer context: active until `end()` (the caller left), which runs the callbacks."""

    def __init__(self, active: bool = True) -> None:
        self.active = active
        self.callbacks: list[Callable[[], object]] = []

    def is_active(self) -> bool:
        return self.active

    def add_callback(self, callback: Callable[[], object]) -> bool:
        if not self.active:
            return False  # as gRPC's: the call has ended, the callback will never run
        self.callbacks.append(callback)
        return True

    def invocation_metadata(self) -> tuple[()]:
        return ()

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise Aborted(code, details)

    def end(self) -> None:
        self.active = False
        for callback in self.callbacks:
            callback()


class ScriptedHold:
    """A KVHold whose KV is in once the test calls `arrive()`."""

    cached_tokens = 0

    def __init__(self) -> None:
        self.started = False
        self.ended: str | None = None  # the reason it was ended with
        self._done = threading.Event()  # arrived or ended

    def start(self) -> None:
        self.started = True

    def arrive(self) -> None:
        self._done.set()

    def wait(self, deadline: float, is_active: Callable[[], bool]) -> bool:
        if not self._done.wait(max(0.0, deadline - time.monotonic())):
            raise DeadlineExceeded("the KV did not arrive before the decode deadline")
        return self.ended is None

    def end(self, reason: str) -> None:
        self.ended = reason
        self._done.set()


def paced(canceled: threading.Event) -> Iterator[Chosen]:
    """An engine's tokens until the job is canceled, one each 10 ms: a decode still running when the test acts."""
    while True:
        yield Chosen(5)
        canceled.wait(0.01)


class ScriptedBackend:
    """A DecodeBackend whose holds are `ScriptedHold`s and whose tokens (Decode's and Generate's, one
    choice) come from `tokens(canceled)`."""

    facts = FACTS
    kv_endpoint = "127.0.0.1:9"

    def __init__(self, tokens: Callable[[threading.Event], Iterator[Chosen]] = paced) -> None:
        self.tokens = tokens
        self.holds: list[ScriptedHold] = []

    def expect(self, expected: Expected, ttl_s: float, events: ShipmentEvents) -> KVHold:
        hold = ScriptedHold()
        self.holds.append(hold)
        return hold

    def check_decode(self, call: DecodeCall, params: SamplingParams) -> None:
        pass

    def check_prompt(self, token_ids: Any, params: SamplingParams) -> None:
        pass

    def decode(self, hold: KVHold, call: DecodeCall, params: SamplingParams, deadline: float,
               canceled: threading.Event) -> list[Iterator[Chosen]]:  # fmt: skip
        return [self.tokens(canceled)]

    def generate(self, token_ids: list[int], params: SamplingParams, deadline: float,
                 canceled: threading.Event, cache_salt: str | None = None) -> Generated:  # fmt: skip
        return Generated([self.tokens(canceled)])

    def decode_text(self, token_ids: list[int]) -> str:
        return ""

    def close(self) -> None:
        pass


def reserve_request(job_id: str, kv_bytes: int = 100, ttl_s: float = 30.0, prefill_grpc: str = "") -> Any:
    return decode_pb2.ReserveRequest(job_id=job_id, attempt=1, tenant="acme", kv_bytes=kv_bytes, ttl_s=ttl_s,
                                     prefill_grpc=prefill_grpc)  # fmt: skip


def decode_request(job_id: str, max_new_tokens: int = 1000) -> Any:
    request = decode_pb2.DecodeRequest(job_id=job_id, attempt=1, first_token=5, timeout_s=30,
                                       sampling=common_pb2.SamplingParams(max_new_tokens=max_new_tokens))  # fmt: skip
    request.kv.model_fingerprint, request.kv.dtype = FACTS.fingerprint, FACTS.dtype
    return request


def generate_request(job_id: str, max_new_tokens: int = 1000) -> Any:
    return decode_pb2.GenerateRequest(job_id=job_id, attempt=1, token_ids=[1, 2, 3], timeout_s=30,
                                      sampling=common_pb2.SamplingParams(max_new_tokens=max_new_tokens))  # fmt: skip


def status(call: Callable[[], object]) -> tuple[grpc.StatusCode, str]:
    """The status a unary call ends with (OK, "" when it returns)."""
    try:
        call()
    except Aborted as aborted:
        return aborted.code, aborted.details
    return grpc.StatusCode.OK, ""


def drain(
    stream: Iterable[object], on_event: Callable[[int], object] = lambda _n: None
) -> tuple[int, grpc.StatusCode, str]:
    """(events, status code, details) of a streaming call run to its end; `on_event(n)` after the n-th event.
    Only the status is kept, not the `Aborted`: its context is the agent's error, whose traceback holds
    the frames it passed."""
    num_events = 0
    try:
        for _event in stream:
            num_events += 1
            on_event(num_events)
    except Aborted as aborted:
        return num_events, aborted.code, aborted.details
    return num_events, grpc.StatusCode.OK, ""
