"""The decode agent's rules at the edges of a call's life: the default reservation TTL, a call
whose caller left before it started, a Cancel, and the region shutting down (local Generate
ends as a split Decode does, UNAVAILABLE: what the control plane marks a region suspect on)."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterable

import grpc
from decode_kit import (
    Context,
    ScriptedBackend,
    decode_request,
    drain,
    generate_request,
    reserve_request,
    status,
)
from region_kit import wait_until

from prfaas.decode_region.agent import DecodeAgent
from prfaas.region.errors import Canceled


def new_job() -> str:
    return str(uuid.uuid4())


def test_an_unset_ttl_is_the_default_capped_at_max_reservation_s() -> None:
    agent = DecodeAgent(ScriptedBackend(), kv_buffer_bytes=1000, max_reservation_s=10.0)
    try:
        assert agent.Reserve(reserve_request(new_job(), ttl_s=0), Context()).expires_in_s == 10.0  # not 60
        assert agent.Reserve(reserve_request(new_job(), ttl_s=4), Context()).expires_in_s == 4.0
        code, _ = status(lambda: agent.Reserve(reserve_request(new_job(), ttl_s=11), Context()))
        assert code == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        agent.close()


class Streams:
    """Streaming calls run on threads to their end: each one's (events, code, details) by name."""

    def __init__(self) -> None:
        self.events: dict[str, int] = {}
        self.ends: dict[str, tuple[int, grpc.StatusCode, str]] = {}
        self.threads: list[threading.Thread] = []

    def run(self, name: str, stream: Iterable[object]) -> None:
        def count(n: int) -> None:
            self.events[name] = n

        def body() -> None:
            self.ends[name] = drain(stream, count)

        thread = threading.Thread(target=body, name=f"test-{name}")
        thread.start()
        self.threads.append(thread)

    def join(self) -> None:
        for thread in self.threads:
            thread.join(10.0)
            assert not thread.is_alive()


def test_close_ends_a_running_generate_unavailable_as_it_ends_a_running_decode() -> None:
    backend = ScriptedBackend()
    agent = DecodeAgent(backend, kv_buffer_bytes=1000, num_workers=2)
    split = new_job()
    agent.Reserve(reserve_request(split), Context())
    backend.holds[0].arrive()
    streams = Streams()
    streams.run("decode", agent.Decode(decode_request(split), Context()))
    streams.run("generate", agent.Generate(generate_request(new_job()), Context()))
    wait_until(lambda: min(streams.events.get("decode", 0), streams.events.get("generate", 0)) >= 3, 10.0)
    agent.close()
    streams.join()
    assert streams.ends["decode"][1:] == (grpc.StatusCode.UNAVAILABLE, "decode region shutting down")
    # CANCELLED before ("canceled during decode"): the control plane marks a region suspect on UNAVAILABLE only
    assert streams.ends["generate"][1:] == (grpc.StatusCode.UNAVAILABLE, "decode region shutting down")


def test_a_canceled_generate_ends_with_the_cancel_s_reason() -> None:
    agent = DecodeAgent(ScriptedBackend(), kv_buffer_bytes=1000)
    job_id = new_job()
    streams = Streams()
    try:
        streams.run("generate", agent.Generate(generate_request(job_id), Context()))
        wait_until(lambda: streams.events.get("generate", 0) >= 3, 10.0)
        assert agent.cancel(job_id, Canceled("canceled by the tenant"))
        streams.join()
        assert streams.ends["generate"][1:] == (grpc.StatusCode.CANCELLED, "canceled by the tenant")
    finally:
        agent.close()


def test_after_close_reserve_and_generate_are_refused_and_hold_nothing() -> None:
    """close() ends what it finds; a Reserve or Generate coming after it (it passed the draining check
    before the region stopped) must not start what no one will end."""
    agent = DecodeAgent(ScriptedBackend(), kv_buffer_bytes=1000)
    agent.close()
    code, details = status(lambda: agent.Reserve(reserve_request(new_job()), Context()))
    assert (code, details) == (grpc.StatusCode.UNAVAILABLE, "decode region shutting down")
    num_events, code, _ = drain(agent.Generate(generate_request(new_job(), 200), Context()))
    assert (num_events, code) == (0, grpc.StatusCode.UNAVAILABLE)
    assert agent.idle() and agent.book.used_bytes == 0


def test_a_generate_whose_call_already_ended_stops_at_once() -> None:
    """gRPC's add_callback returns False when the call has ended: the callback will never run, so
    the job is canceled then (before, it ran all its tokens for no one)."""
    agent = DecodeAgent(ScriptedBackend(), kv_buffer_bytes=1000)
    try:
        num_events, code, _ = drain(agent.Generate(generate_request(new_job(), 200), Context(active=False)))
        assert code == grpc.StatusCode.CANCELLED and num_events <= 1
        assert agent.idle()
    finally:
        agent.close()


def test_a_decode_whose_call_already_ended_ends_its_reservation() -> None:
    backend = ScriptedBackend()
    agent = DecodeAgent(backend, kv_buffer_bytes=1000)
    try:
        job_id = new_job()
        agent.Reserve(reserve_request(job_id, 400), Context())
        backend.holds[0].arrive()
        num_events, code, _ = drain(agent.Decode(decode_request(job_id, 200), Context(active=False)))
        assert (num_events, code) == (0, grpc.StatusCode.CANCELLED)
        assert agent.idle() and agent.book.used_bytes == 0
    finally:
        agent.close()
