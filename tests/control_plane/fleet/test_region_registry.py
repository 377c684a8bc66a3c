"""The region registry over real gRPC (the regions' own `Heartbeater` client) on the real
Redis: register, heartbeats carry load into the ClusterSnapshot, three missed beats -> dead,
a registry that forgot a region asks it to register again, operator drain."""

from __future__ import annotations

import time
from collections.abc import Iterator

import grpc
import pytest
import redis
from cp_kit import settings_fixture

from prfaas.control_plane.fleet.registry import RegionRegistry
from prfaas.control_plane.fleet.server import serve_registry
from prfaas.control_plane.scheduling.snapshot import Link, ModelShape
from prfaas.protos.prfaas.v1 import registry_pb2, registry_pb2_grpc
from prfaas.region.registry_client import Heartbeater

INTERVAL_S = 0.2
MODEL = ModelShape(name="tiny-llama", num_layers=4, kv_bytes_per_token=1024)


@pytest.fixture
def registry() -> Iterator[tuple[RegionRegistry, str]]:
    for settings in settings_fixture():
        client = redis.Redis.from_url(settings.redis_url)
        reg = RegionRegistry(client, settings)
        server, address = serve_registry(reg, "127.0.0.1:0")
        yield reg, address
        server.stop(0)
        client.close()


def _registration(name: str, role: str, price: float) -> registry_pb2.RegisterRequest:
    return registry_pb2.RegisterRequest(
        name=name, role=role, gpu_type="cpu", num_workers=2, usd_per_gpu_hour=price,
        grpc_endpoint="127.0.0.1:1", kv_endpoint="127.0.0.1:2" if role != "prefill" else "",
        model="tiny-llama", kv_buffer_bytes=1 << 20 if role != "prefill" else 0, heartbeat_interval_s=INTERVAL_S,
    )  # fmt: skip


def _load(queue: int) -> registry_pb2.Load:
    return registry_pb2.Load(queue_depth=queue, busy_workers=1, kv_free_bytes=1000, decode_tokens_per_s=40.0)


def test_heartbeats_build_the_snapshot(registry: tuple[RegionRegistry, str]) -> None:
    reg, address = registry
    beaters = [
        Heartbeater(address, _registration("p-a", "prefill", 1.0), lambda: _load(3), INTERVAL_S),
        Heartbeater(address, _registration("d-b", "decode", 4.0), lambda: _load(0), INTERVAL_S),
    ]
    for beater in beaters:
        beater.beat()
    reg.set_link(Link(src="p-a", dst="d-b", rtt_ms=20, bandwidth_gbps=10))

    snapshot = reg.snapshot(MODEL)

    by_name = snapshot.regions_by_name()
    assert set(by_name) == {"p-a", "d-b"}
    assert by_name["p-a"].queue_depth == 3 and by_name["p-a"].kv_buffer_free_bytes == 0
    assert by_name["d-b"].kv_buffer_free_bytes == 1000 and by_name["d-b"].tpot_ms == pytest.approx(25.0)
    assert all(r.healthy for r in snapshot.regions)
    assert [(link.src, link.dst) for link in snapshot.links_into("d-b")] == [("p-a", "d-b")]
    for beater in beaters:
        beater._channel.close()


def test_three_missed_beats_mark_a_region_dead(registry: tuple[RegionRegistry, str]) -> None:
    reg, address = registry
    beater = Heartbeater(address, _registration("d-b", "decode", 4.0), lambda: _load(0), INTERVAL_S)
    beater.start()
    time.sleep(4 * INTERVAL_S)
    assert reg.get("d-b").alive
    beater._stop.set()  # the region goes silent (no farewell beat)
    beater._thread.join(2)
    last = reg.get("d-b").last_beat_at
    time.sleep(2 * INTERVAL_S)
    assert reg.get("d-b").alive  # two missed beats: still alive
    time.sleep(1.5 * INTERVAL_S)
    record = reg.get("d-b")
    assert not record.alive and record.last_beat_at == last
    assert not reg.snapshot(MODEL).region("d-b").healthy
    beater._channel.close()


def test_unknown_region_is_asked_to_register_again(registry: tuple[RegionRegistry, str]) -> None:
    reg, address = registry
    beater = Heartbeater(address, _registration("d-b", "decode", 4.0), lambda: _load(0), INTERVAL_S)
    beater.beat()
    first_id = beater.region_id
    reg.redis.delete(reg.settings.key("region", "d-b"))  # the registry lost its record
    beater.beat()
    assert beater.region_id == ""  # told to re-register
    beater.beat()
    assert beater.region_id not in ("", first_id)
    assert reg.get("d-b").alive
    beater._channel.close()


def test_drain_marks_the_region_unhealthy_until_undrained(registry: tuple[RegionRegistry, str]) -> None:
    reg, address = registry
    beater = Heartbeater(address, _registration("d-b", "decode", 4.0), lambda: _load(0), INTERVAL_S)
    beater.beat()
    assert not reg.set_drained("d-b", True).healthy
    assert not reg.snapshot(MODEL).region("d-b").healthy
    assert reg.set_drained("d-b", False).healthy
    beater._channel.close()


def test_register_with_a_bad_role_is_invalid_argument(registry: tuple[RegionRegistry, str]) -> None:
    _reg, address = registry
    with grpc.insecure_channel(address) as channel:
        stub = registry_pb2_grpc.RegistryStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.Register(registry_pb2.RegisterRequest(name="x", role="everything"), timeout=5)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
