"""The prefill region's KV channel pool (prefill_region/shipping.py) against destinations that never answer
(real TCP channels dialing a closed port): a channel no shipment uses is closed after IDLE_CLOSE_S, and no
more than MAX_CHANNELS are open however many destinations requests name. Before, each distinct (endpoint,
decode_region) kept a channel, a reaper, an encoder pool and a redialing thread per stream for the process's
life: 20 failed Prefills held about 690 threads. In a region: a channel checked out to a job that has not
submitted yet is never closed to make room, and none is opened once the pool is closed."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from region_kit import local_region, new_job, prefill_request, split_generate, ticket

from prfaas.devstack.processes import free_port, wait_until
from prfaas.engine.hf import HFEngine
from prfaas.engine.sampling import SamplingParams
from prfaas.prefill_region import shipping
from prfaas.prefill_region.destination import Destination
from prfaas.prefill_region.hf_backend import HFPrefill
from prfaas.prefill_region.shipping import Channel, ChannelPool
from prfaas.protos.prfaas.v1 import prefill_pb2
from prfaas.transport.api import Shipment, Transfer
from prfaas.transport.endpoints import Endpoint, parse_endpoint

GREEDY = SamplingParams(max_new_tokens=4, ignore_eos=True)


def _to(port: int, region: str) -> Destination:
    return Destination(parse_endpoint(f"127.0.0.1:{port}"), "ticket", "raw", decode_region=region, num_streams=2)


def _checked_out(pool: ChannelPool, destination: Destination) -> Channel:
    """A channel checked out and given back at once (no shipment submitted to it)."""
    with pool.checkout(destination) as channel:
        return channel


def test_idle_channels_close_and_at_most_max_channels_are_open(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shipping, "MAX_CHANNELS", 4)
    monkeypatch.setattr(shipping, "IDLE_CLOSE_S", 0.3)
    threads = threading.active_count()
    pool = ChannelPool("pre")
    port = free_port()  # nothing listens there: every stream redials
    try:
        opened = [_checked_out(pool, _to(port, f"dec-{i}")) for i in range(10)]  # request-named regions, all distinct
        assert pool.num_open() == 4  # the least recently used idle ones made room
        assert all(channel.closed.is_set() for channel in opened[:6])
        again = _checked_out(pool, _to(port, "dec-9"))
        assert again is opened[9]  # the same destination, the same channel
        time.sleep(0.4)
        assert pool.path_reports() == [] and pool.num_open() == 0  # a heartbeat closes the idle ones
        wait_until(lambda: all(channel.closed.is_set() for channel in opened), timeout_s=10)
        wait_until(lambda: threading.active_count() <= threads + 2, timeout_s=15)  # their threads are gone
    finally:
        pool.close()


@pytest.fixture
def silent_kv_ports() -> Iterator[list[str]]:
    """Two KV endpoints that accept connections and never answer."""
    holes = [socket.create_server(("127.0.0.1", 0), backlog=64) for _ in range(2)]
    held: list[socket.socket] = []
    for hole in holes:
        threading.Thread(target=lambda h=hole: [held.append(h.accept()[0]) for _ in range(64)], daemon=True).start()
    yield [f"127.0.0.1:{hole.getsockname()[1]}" for hole in holes]
    for hole in holes:
        hole.close()


def _code(call: Iterator[Any]) -> grpc.StatusCode:
    try:
        list(call)
    except grpc.RpcError as exc:
        return exc.code()  # type: ignore[no-any-return, attr-defined]
    return grpc.StatusCode.OK


def test_a_channel_handed_to_a_job_is_not_closed_to_make_room_for_another(
    tiny_engine: HFEngine, silent_kv_ports: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two channels at most: A's carries a shipment no one reads; B's job has its channel and has not submitted
    yet (held there until C's job is done with the pool) when C's job names a third endpoint. C is
    RESOURCE_EXHAUSTED and B ships and completes (before, B's idle-looking channel was closed for C, and B, whose
    decode region was fine, failed UNAVAILABLE "channel is closed")."""
    monkeypatch.setattr(shipping, "MAX_CHANNELS", 2)
    region = local_region(tiny_engine, workers=3)
    try:
        assert region.prefill is not None and isinstance(region.prefill.backend, HFPrefill)
        pool = region.prefill.backend.channels
        busy_port, c_port = silent_kv_ports
        ids = list(range(5, 69))
        kv_bytes = len(ids) * tiny_engine.kv_bytes_per_token
        busy = region.prefill_stub.Prefill(prefill_request(new_job(), ids, GREEDY, busy_port, timeout_s=30),
                                           timeout=40)  # fmt: skip
        wait_until(lambda: pool.num_open() == 1 and all(ch.table.live() for ch in pool._channels.values()), 10)
        c_code: list[grpc.StatusCode] = []
        opened, hooked = pool._open, []

        def open_(endpoint: Endpoint, region_name: str, streams: int | None = None) -> Channel:
            channel = opened(endpoint, region_name, streams)
            if hooked:  # B's channel only (the first opened from here on)
                return channel
            hooked.append(channel)
            submit = channel.submit

            def handed_over(shipment: Shipment) -> Transfer:  # B's job, between its check-out and its submit
                call = region.prefill_stub.Prefill(prefill_request(new_job(), ids, GREEDY, c_port, timeout_s=2),
                                                   timeout=10)  # fmt: skip
                threading.Thread(target=lambda: c_code.append(_code(call)), daemon=True).start()
                wait_until(lambda: c_code or channel not in pool._channels.values(), timeout_s=10)
                if channel not in pool._channels.values():  # made room with: wait for its close to begin
                    wait_until(lambda: channel._closing or channel.closed.is_set(), timeout_s=5)  # type: ignore[union-attr]
                return submit(shipment)

            channel.submit = handed_over  # type: ignore[method-assign]
            return channel

        monkeypatch.setattr(pool, "_open", open_)
        run = split_generate(region.prefill_stub, region.decode_stub, ids, GREEDY, kv_bytes)
        assert run.events[-1].HasField("shipment_complete") and len(run.tokens) == GREEDY.max_new_tokens
        assert c_code == [grpc.StatusCode.RESOURCE_EXHAUSTED]
        busy.cancel()
    finally:
        region.close()


def test_a_reship_racing_the_region_stop_opens_no_channel(
    tiny_engine: HFEngine, silent_kv_ports: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The region stops while a Reship it admitted takes its lease (close() run from there): the Reship ends
    UNAVAILABLE and no channel is open after the pool closed (before, one was opened after it, its reaper,
    encoder pool and stream threads redialing for the process's life)."""
    region = local_region(tiny_engine, decode=False)
    try:
        agent = region.prefill
        assert agent is not None and isinstance(agent.backend, HFPrefill)
        pool, leases = agent.backend.channels, agent.backend.leases
        job_id = new_job()
        leases.put(job_id, tiny_engine.prefill(list(range(1, 33)), GREEDY), attempt=1)
        hold = leases.hold

        def stop_then_hold(held_job: str) -> Any:
            agent.close()
            return hold(held_job)

        monkeypatch.setattr(leases, "hold", stop_then_hold)
        destination = prefill_pb2.Destination(kv_endpoint=silent_kv_ports[0], ticket=ticket(job_id, 2), codec="raw")
        request = prefill_pb2.ReshipRequest(job_id=job_id, attempt=2, destination=destination, timeout_s=10)
        with pytest.raises(grpc.RpcError) as info:
            region.prefill_stub.Reship(request, timeout=20)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert pool.num_open() == 0
    finally:
        region.close()
