"""The region registry over real gRPC (the regions' own `Heartbeater` client) on the real
Redis: register, heartbeats carry load into the ClusterSnapshot, three missed beats -> dead,
a registry that forgot a region asks it to register again, operator drain; a region as a
pool of instances (summed, the least loaded picked, one dying leaves the others); with
mutual TLS, only a certificate naming the region may register or beat as it."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
import redis
from cp_kit import settings_fixture
from fastapi import HTTPException
from pydantic import ValidationError
from test_link_estimates import LINK, link_report

from prfaas.control_plane.api.regions import delete_link, list_links, put_link
from prfaas.control_plane.api.schemas import LinkPublic
from prfaas.control_plane.fleet.registry import RegionRegistry
from prfaas.control_plane.fleet.server import serve_registry
from prfaas.control_plane.jobs.placement import decode_instance
from prfaas.control_plane.scheduling import Request, Slo, build_scheduler
from prfaas.control_plane.scheduling.errors import InsufficientCapacity, NoHealthyRegion
from prfaas.control_plane.scheduling.snapshot import Link, ModelShape
from prfaas.protos.prfaas.v1 import registry_pb2, registry_pb2_grpc
from prfaas.region.channels import TlsFiles, channel
from prfaas.region.registry_client import Heartbeater
from prfaas.transport.identity import Identity, server_name
from prfaas.transport.tls import init_certs

INTERVAL_S = 0.2
MODEL = ModelShape(name="tiny-llama", num_layers=4, kv_bytes_per_token=1024)
MiB = 2**20


@pytest.fixture
def registry() -> Iterator[tuple[RegionRegistry, str]]:
    for settings in settings_fixture():
        client = redis.Redis.from_url(settings.redis_url)
        reg = RegionRegistry(client, settings)
        server, address = serve_registry(reg, "127.0.0.1:0")
        yield reg, address
        server.stop(0)
        client.close()


def _registration(name: str, role: str, price: float, instance: str = "") -> registry_pb2.RegisterRequest:
    return registry_pb2.RegisterRequest(
        name=name, role=role, gpu_type="cpu", num_workers=2, usd_per_gpu_hour=price,
        grpc_endpoint="127.0.0.1:1", kv_endpoint="127.0.0.1:2" if role != "prefill" else "",
        model="tiny-llama", kv_buffer_bytes=1 << 20 if role != "prefill" else 0, heartbeat_interval_s=INTERVAL_S,
        instance=instance,
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
    last = reg.get("d-b").instances[0].last_beat_at
    # timed from the last beat itself (the join above may take an interval on a busy host)
    time.sleep(max(0.0, last + 1.5 * INTERVAL_S - time.time()))
    assert reg.get("d-b").alive  # beats missed, fewer than three: still alive
    time.sleep(max(0.0, last + 3.5 * INTERVAL_S - time.time()))
    record = reg.get("d-b")
    assert not record.alive and record.instances[0].last_beat_at == last
    assert not reg.snapshot(MODEL).region("d-b").healthy
    beater._channel.close()


def test_unknown_region_is_asked_to_register_again(registry: tuple[RegionRegistry, str]) -> None:
    reg, address = registry
    beater = Heartbeater(address, _registration("d-b", "decode", 4.0), lambda: _load(0), INTERVAL_S)
    beater.beat()
    first_id = beater.region_id
    reg.redis.delete(reg.settings.key("instance", "d-b/0"))  # the registry lost its record
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


def test_a_region_is_the_sum_of_its_instances_and_work_goes_to_the_least_loaded(
    registry: tuple[RegionRegistry, str],
) -> None:
    reg, address = registry
    busy = Heartbeater(address, _registration("d-b", "decode", 4.0, "i-1"), lambda: _load(5), INTERVAL_S)
    idle = Heartbeater(address, _registration("d-b", "decode", 4.0, "i-2"), lambda: _load(0), INTERVAL_S)
    for beater in (busy, idle):
        beater.beat()
    region = reg.get("d-b")
    assert [i.instance for i in region.instances] == ["i-1", "i-2"]
    assert region.num_workers == 4 and region.queue_depth == 5 and region.kv_free_bytes == 2000  # summed
    assert region.pick().instance == "i-2"  # (0 + 1) / 2 workers beats (5 + 1) / 2
    assert region.pick(frozenset({"d-b/i-2"})).instance == "i-1"  # the one a failed attempt excludes
    snap = reg.snapshot(MODEL, exclude=frozenset({"d-b/i-2"})).region("d-b")
    # one instance excluded: the region still serves, with what the retry may use (i-1's workers and queue)
    assert snap.healthy and (snap.num_workers, snap.queue_depth) == (2, 5)
    assert not reg.snapshot(MODEL, exclude=frozenset({"d-b/i-1", "d-b/i-2"})).region("d-b").healthy
    for beater in (busy, idle):
        beater._channel.close()


def test_an_instance_that_dies_leaves_its_region_to_the_others(registry: tuple[RegionRegistry, str]) -> None:
    reg, address = registry
    dying = Heartbeater(address, _registration("d-b", "decode", 4.0, "i-1"), lambda: _load(0), INTERVAL_S)
    staying = Heartbeater(address, _registration("d-b", "decode", 4.0, "i-2"), lambda: _load(3), INTERVAL_S)
    dying.beat()
    staying.start()
    time.sleep(4.5 * INTERVAL_S)  # i-1 missed three beats; i-2 beat every interval
    region = reg.get("d-b")
    assert [(i.instance, i.alive) for i in region.instances] == [("i-1", False), ("i-2", True)]
    assert region.healthy and region.pick().instance == "i-2" and region.num_workers == 2
    staying.stop()
    dying._channel.close()


def test_instances_silent_for_long_are_forgotten(registry: tuple[RegionRegistry, str]) -> None:
    reg, address = registry
    Heartbeater(address, _registration("d-b", "decode", 4.0, "gone"), lambda: _load(0), INTERVAL_S).beat()
    Heartbeater(address, _registration("d-b", "decode", 4.0, "here"), lambda: _load(0), INTERVAL_S).beat()
    reg.redis.hset(reg.settings.key("instance", "d-b/gone"), "last_beat_at", time.time() - 301)
    assert [i.instance for i in reg.get("d-b").instances] == ["here"]
    assert not reg.redis.exists(reg.settings.key("instance", "d-b/gone"))


def test_an_instance_cannot_join_a_region_as_another_role(registry: tuple[RegionRegistry, str]) -> None:
    _reg, address = registry
    Heartbeater(address, _registration("d-b", "decode", 4.0, "i-1"), lambda: _load(0), INTERVAL_S).beat()
    with grpc.insecure_channel(address) as channel:
        stub = registry_pb2_grpc.RegistryStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.Register(_registration("d-b", "prefill", 4.0, "i-2"), timeout=5)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "its instance i-1 serves decode" in (info.value.details() or "")


def test_a_webrtc_region_has_one_live_instance(registry: tuple[RegionRegistry, str]) -> None:
    """WebRTC offers are addressed to a region (webrtc://<region>): with two live instances, the KV of a job went
    to whichever instance took the offer, not to the one the control plane had reserved on. A second live
    instance is refused with a clear error; the same instance registering again, or another one once the first
    is dead, is let in."""
    reg, address = registry

    def rtc(instance: str) -> registry_pb2.RegisterRequest:
        request = _registration("d-rtc", "decode", 4.0, instance)
        request.kv_endpoint = "webrtc://d-rtc"
        return request

    Heartbeater(address, rtc("i-1"), lambda: _load(0), INTERVAL_S).beat()
    with grpc.insecure_channel(address) as channel:
        stub = registry_pb2_grpc.RegistryStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.Register(rtc("i-2"), timeout=5)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "receives KV over WebRTC" in (info.value.details() or "") and "i-1 is alive" in info.value.details()
        assert [i.instance for i in reg.get("d-rtc").instances] == ["i-1"]
        assert stub.Register(rtc("i-1"), timeout=5).region_id  # i-1 restarted
        reg.redis.hset(reg.settings.key("instance", "d-rtc/i-1"), "last_beat_at", time.time() - 10)  # i-1 died
        assert stub.Register(rtc("i-2"), timeout=5).region_id
    assert [(i.instance, i.alive) for i in reg.get("d-rtc").instances] == [("i-1", False), ("i-2", True)]


def test_a_regions_kv_dtype_reaches_the_snapshot_and_its_instances_agree_on_it(
    registry: tuple[RegionRegistry, str],
) -> None:
    reg, address = registry
    gpu = _registration("d-b", "decode", 4.0, "i-1")
    gpu.kv_dtype = "bfloat16"
    Heartbeater(address, gpu, lambda: _load(0), INTERVAL_S).beat()
    Heartbeater(address, _registration("p-a", "prefill", 1.0), lambda: _load(0), INTERVAL_S).beat()  # says none
    snapshot = reg.snapshot(MODEL)
    assert (snapshot.region("d-b").kv_dtype, snapshot.region("p-a").kv_dtype) == ("bfloat16", None)
    with grpc.insecure_channel(address) as channel:
        stub = registry_pb2_grpc.RegistryStub(channel)
        other = _registration("d-b", "decode", 4.0, "i-2")
        other.kv_dtype = "float32"
        with pytest.raises(grpc.RpcError) as info:
            stub.Register(other, timeout=5)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "KV dtype float32; its instance i-1 serves decode" in (info.value.details() or "")
        older = _registration("d-b", "decode", 4.0, "i-3")  # a region binary from before kv_dtype: not refused
        assert stub.Register(older, timeout=5).region_id
        odd = _registration("x-c", "decode", 4.0)
        odd.kv_dtype = "int8"
        with pytest.raises(grpc.RpcError) as info:
            stub.Register(odd, timeout=5)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "kv_dtype 'int8' is none of float32, bfloat16, float16" in (info.value.details() or "")


@pytest.fixture
def tls_registry(tmp_path: Path) -> Iterator[tuple[RegionRegistry, str, dict[str, TlsFiles]]]:
    issue = {"cp": "prfaas://control-plane/prod", "d-b": "prfaas://decode/d-b/1", "p-a": "prfaas://prefill/p-a/*"}
    init_certs(tmp_path, list(issue), ["127.0.0.1"], identities={n: Identity.parse(u) for n, u in issue.items()})
    files = {n: TlsFiles(ca=str(tmp_path / "ca.pem"), cert=str(tmp_path / f"{n}.pem"),
                         key=str(tmp_path / f"{n}-key.pem")) for n in issue}  # fmt: skip
    for settings in settings_fixture(tls=files["cp"]):
        client = redis.Redis.from_url(settings.redis_url)
        reg = RegionRegistry(client, settings)
        server, address = serve_registry(reg, "127.0.0.1:0", settings.tls)
        yield reg, address, files
        server.stop(0)
        client.close()


def test_only_a_regions_certificate_registers_it_and_the_real_instance_keeps_serving(
    tls_registry: tuple[RegionRegistry, str, dict[str, TlsFiles]],
) -> None:
    reg, address, files = tls_registry
    real = Heartbeater(address, _registration("d-b", "decode", 4.0, "1"), lambda: _load(0), INTERVAL_S, files["d-b"])
    real.beat()
    token = reg.get("d-b").instances[0].token

    def register_as_d_b(tls: TlsFiles | None) -> grpc.StatusCode:
        stub = registry_pb2_grpc.RegistryStub(channel(address, tls, server_name(None)))
        with pytest.raises(grpc.RpcError) as info:
            stub.Register(_registration("d-b", "decode", 0.01, "1"), timeout=5)
        return info.value.code()

    assert register_as_d_b(files["p-a"]) == grpc.StatusCode.PERMISSION_DENIED  # another region's certificate
    assert register_as_d_b(files["cp"]) == grpc.StatusCode.PERMISSION_DENIED  # not a region at all
    assert register_as_d_b(None) == grpc.StatusCode.UNAVAILABLE  # no certificate: no handshake
    region = reg.get("d-b")
    assert [(i.instance, i.token, i.usd_per_gpu_hour) for i in region.instances] == [("1", token, 4.0)]
    real.beat()  # still its own
    assert real.region_id == token and reg.get("d-b").healthy
    with pytest.raises(grpc.RpcError) as info:  # nor may another region beat for it
        registry_pb2_grpc.RegistryStub(channel(address, files["p-a"], server_name(None))).Heartbeat(
            registry_pb2.HeartbeatRequest(name="d-b", instance="1", region_id=token), timeout=5
        )
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    shared = Heartbeater(address, _registration("p-a", "prefill", 1.0, "i-7"), lambda: _load(0), INTERVAL_S,
                         files["p-a"])  # fmt: skip
    shared.beat()  # a certificate for every instance of p-a (*) registers any of them
    assert [i.instance for i in reg.get("p-a").instances] == ["i-7"]
    for beater in (real, shared):
        beater._channel.close()


def test_only_a_region_that_sends_kv_may_offer_a_connection(
    tls_registry: tuple[RegionRegistry, str, dict[str, TlsFiles]],
) -> None:
    """With TLS, a decode region's certificate may not post WebRTC offers to other regions (before, any region
    could fill a region's offer queue and every signalling slot of the fleet); a prefill region's may."""
    _reg, address, files = tls_registry
    offer = registry_pb2.SignalRequest(region="d-b", offer_sdp="v=0", timeout_s=0.5)
    for name, code in (("d-b", grpc.StatusCode.PERMISSION_DENIED), ("p-a", grpc.StatusCode.DEADLINE_EXCEEDED)):
        stub = registry_pb2_grpc.RegistryStub(channel(address, files[name], server_name(None)))
        with pytest.raises(grpc.RpcError) as info:
            stub.Signal(offer, timeout=5)
        assert info.value.code() == code, (name, info.value.details())  # p-a's: no one answered in 0.5 s


def test_only_the_region_an_offer_is_addressed_to_may_answer_it(
    tls_registry: tuple[RegionRegistry, str, dict[str, TlsFiles]],
) -> None:
    """Before, any region's certificate could answer any offer (its id read off the wire, or guessed) and point
    another region's sender at a peer of its own choosing."""
    _reg, address, files = tls_registry
    stubs = {name: registry_pb2_grpc.RegistryStub(channel(address, files[name], server_name(None))) for name in files}
    sent = stubs["p-a"].Signal.future(registry_pb2.SignalRequest(region="d-b", offer_sdp="v=0", timeout_s=5), timeout=8)
    offers = stubs["d-b"].Offers(registry_pb2.OffersRequest(region="d-b"), timeout=5)
    offer = next(offers)
    with pytest.raises(grpc.RpcError) as info:
        stubs["p-a"].Answer(registry_pb2.SignalAnswer(id=offer.id, answer_sdp="forged"), timeout=5)
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    stubs["d-b"].Answer(registry_pb2.SignalAnswer(id=offer.id, answer_sdp="real"), timeout=5)
    assert sent.result().answer_sdp == "real"
    offers.cancel()


def test_an_instance_that_refused_a_call_gets_no_new_work_until_its_mark_expires(
    registry: tuple[RegionRegistry, str],
) -> None:
    reg, address = registry
    beaters = [
        Heartbeater(address, _registration("d-b", "decode", 4.0, name), lambda: _load(0), INTERVAL_S)
        for name in ("i-1", "i-2")
    ]
    for beater in beaters:
        beater.beat()
    reg.suspect("d-b/i-1")  # the dispatcher's Reserve got UNAVAILABLE from it
    region = reg.get("d-b")
    assert region.healthy and [i.instance for i in region.healthy_instances] == ["i-2"]
    assert region.pick().instance == "i-2"
    time.sleep(reg.settings.heartbeat_misses * INTERVAL_S + 0.1)
    for beater in beaters:
        beater.beat()
    assert reg.get("d-b").pick().instance == "i-1"  # back: the least loaded again (ties go by id)
    for beater in beaters:
        beater._channel.close()


def test_heartbeats_carry_link_reports_into_the_snapshot(registry: tuple[RegionRegistry, str]) -> None:
    """A prefill region's beats (real gRPC registry, real Redis) move the link it ships on."""
    reg, address = registry
    reg.set_link(LINK)
    reports = [[link_report(2.0, seconds=30.0)]]  # one beat's worth: the meter hands each window once
    beater = Heartbeater(address, _registration("pre", "prefill", 1.0),
                         lambda: registry_pb2.Load(links=reports.pop() if reports else []), 0.2)  # fmt: skip
    decode = Heartbeater(address, _registration("dec", "decode", 4.0), registry_pb2.Load, 0.2)
    decode.beat()
    beater.beat()
    beater.beat()
    for b in (beater, decode):
        b._channel.close()

    (link,) = reg.snapshot(MODEL).links_into("dec")
    assert link.bandwidth_gbps == pytest.approx(2.0) and link.rtt_ms == 40.0
    assert reg.configured_links() == [LINK]  # what the operator set is kept beside
    static = RegionRegistry(reg.redis, reg.settings.model_copy(update={"measure_links": False}))
    assert static.links() == [LINK]  # PRFAAS_MEASURE_LINKS=false: the configured links only
    estimate = reg.link_estimates()[("pre", "dec")]
    assert estimate.retransmits == 3 and estimate.age_s(reg.clock()) < 5


def test_a_region_that_ran_nothing_yet_is_assumed_as_fast_as_its_measured_peers(
    registry: tuple[RegionRegistry, str],
) -> None:
    """A fixed low fallback would make a new region look slower and dearer than every measured
    one, so it would never get the job that measures it."""
    reg, address = registry
    loads = {"p-old": registry_pb2.Load(prefill_tokens_per_s=9000.0), "p-new": registry_pb2.Load()}
    beaters = [
        Heartbeater(address, _registration(name, "prefill", 1.0), lambda name=name: loads[name], INTERVAL_S)
        for name in loads
    ]
    for beater in beaters:
        beater.beat()
        beater.beat()

    by_name = reg.snapshot(MODEL).regions_by_name()

    assert by_name["p-new"].prefill_tokens_per_s == by_name["p-old"].prefill_tokens_per_s == 9000.0
    for beater in beaters:
        beater._channel.close()


def test_published_prefix_blocks_reach_the_snapshot_and_the_instance_pick(
    registry: tuple[RegionRegistry, str],
) -> None:
    reg, address = registry
    aa, bb, cc, dd, zz = (c * 16 for c in "abcdf")  # short digests (engine/blocks.py `short`: 16 hex digits)
    held = {"1": [aa, bb, cc], "2": [aa]}  # instance 2 holds only the first block of the prompt

    def published(instance: str) -> Callable[[], registry_pb2.Load]:
        return lambda: registry_pb2.Load(
            kv_free_bytes=1000, prefix_version=1, prefix_blocks=held[instance], prefix_included=True
        )

    beaters = {i: Heartbeater(address, _registration("d-b", "decode", 4.0, instance=i), published(i), INTERVAL_S)
               for i in held}  # fmt: skip
    for beater in beaters.values():
        beater.beat()
    region = reg.get("d-b")
    assert region.prefix_blocks == {aa, bb, cc}
    assert reg.snapshot(MODEL).region("d-b").cached_prefix_hashes == {aa, bb, cc}
    assert region.pick(prefix=(aa, bb, cc, dd)).instance == "1"  # the longest run of the prompt's blocks
    assert region.pick(prefix=(zz,)).instance in {"1", "2"}

    beaters["1"]._load = lambda: registry_pb2.Load(kv_free_bytes=1000, prefix_version=1)  # not included: kept
    beaters["1"].beat()
    assert reg.get("d-b").prefix_blocks == {aa, bb, cc}
    beaters["1"]._load = lambda: registry_pb2.Load(kv_free_bytes=1000, prefix_version=2, prefix_included=True)
    beaters["1"].beat()  # emptied: included with no blocks
    assert reg.get("d-b").prefix_blocks == {aa}
    for beater in beaters.values():
        beater._channel.close()


def test_work_in_tokens_reaches_the_snapshot_summed_over_instances(registry: tuple[RegionRegistry, str]) -> None:
    reg, address = registry
    for instance, (queued, running) in {"1": (3000, 500), "2": (1000, 0)}.items():
        load = registry_pb2.Load(queue_depth=1, busy_workers=1, queued_prefill_tokens=queued,
                                 running_prefill_tokens=running, decode_running=2, decode_slots=4)  # fmt: skip
        beater = Heartbeater(address, _registration("p-a", "prefill", 1.0, instance), lambda load=load: load, 1.0)
        beater.beat()
        beater._channel.close()
    region = reg.snapshot(MODEL).region("p-a")
    assert (region.queued_prefill_tokens, region.running_prefill_tokens) == (4000, 500)
    assert (region.decode_running, region.decode_slots) == (4, 8)


def test_a_load_that_cannot_be_read_once_does_not_end_the_heartbeats(registry: tuple[RegionRegistry, str]) -> None:
    """The heartbeat thread outlives an error that is not gRPC's (a figure the message cannot carry): the next
    beat goes out (before, the thread died and the region aged out of the fleet for good)."""
    reg, address = registry
    failed: list[bool] = []

    def load() -> registry_pb2.Load:
        if not failed:
            failed.append(True)
            return registry_pb2.Load(queue_depth=-1)  # uint32: ValueError
        return _load(0)

    beater = Heartbeater(address, _registration("d-b", "decode", 4.0), load, INTERVAL_S)
    beater.start()
    deadline = time.monotonic() + 10 * INTERVAL_S
    while beater.seq < 2 and time.monotonic() < deadline:
        time.sleep(INTERVAL_S / 4)
    assert failed and beater.seq >= 2 and reg.get("d-b").alive
    beater.stop()


ROOMY = registry_pb2.Load(kv_free_bytes=1 << 30, decode_tokens_per_s=40.0)
SHORT = Request(request_id="r", tenant="t", prompt_tokens=100, max_new_tokens=10, slo=Slo(ttft_ms=60_000, tpot_ms=1000))


def _join(reg: RegionRegistry, name: str, instance: str = "", load: registry_pb2.Load = ROOMY, **fields: Any) -> str:
    """Register an instance (fields override the registration) and beat once with `load`; -> its token."""
    registration = _registration(name, "decode", 4.0, instance)
    for field, value in fields.items():
        setattr(registration, field, value)
    token = reg.register(registration)
    assert not reg.heartbeat(registry_pb2.HeartbeatRequest(name=name, region_id=token, instance=instance, load=load))
    return token


def test_a_region_beating_every_30_s_is_placed_between_its_beats(registry: tuple[RegionRegistry, str]) -> None:
    """A region may beat every 60 s; the registry counts it alive for 3 missed intervals, and the snapshot
    carries its interval so the default policy's `health` filter ages it alike. (Before, the filter's fixed
    15 s cut a live region from 15 s after each beat to the next.)"""
    reg, _address = registry
    _join(reg, "d-b", heartbeat_interval_s=30.0)
    beat_key = reg.settings.key("instance", "d-b/0")
    reg.redis.hset(beat_key, "last_beat_at", time.time() - 29)  # its next beat is due in 1 s
    snapshot = reg.snapshot(MODEL)
    assert build_scheduler().decide(snapshot, SHORT).decode_region == "d-b"
    assert snapshot.region("d-b").heartbeat_interval_s == 30.0 and snapshot.region("d-b").heartbeat_age_s >= 29
    reg.redis.hset(beat_key, "last_beat_at", time.time() - 91)  # 3 beats missed: dead for both
    with pytest.raises(NoHealthyRegion):
        build_scheduler().decide(reg.snapshot(MODEL), SHORT)


def test_a_reservation_goes_to_an_instance_whose_kv_buffer_holds_it(registry: tuple[RegionRegistry, str]) -> None:
    """A decode reservation lands on one instance: the snapshot carries the largest free buffer of one (what
    the `capacity` filter checks) and `pick` takes an instance that holds the KV before a prefix hit. (Before,
    the sum over instances passed and `pick` chose by prefix, then load: a 600 MiB reservation went to the
    instance with 100 MiB free, which refused it.)"""
    reg, _address = registry
    blocks = [f"{i:016x}" for i in range(1, 9)]
    with_prefix = registry_pb2.Load(kv_free_bytes=100 * MiB, prefix_included=True, prefix_version=1,
                                    prefix_blocks=blocks)  # fmt: skip
    _join(reg, "d-b", "a", with_prefix)
    _join(reg, "d-b", "b", registry_pb2.Load(kv_free_bytes=2048 * MiB))
    snap = reg.snapshot(MODEL).region("d-b")
    assert (snap.kv_buffer_free_bytes, snap.kv_buffer_largest_free_bytes) == (2148 * MiB, 2048 * MiB)
    region, prefix = reg.get("d-b"), tuple(blocks)
    assert region.pick(prefix=prefix).instance == "a"  # no size asked: the prefix first, as ever
    assert region.pick(prefix=prefix, kv_bytes=600 * MiB).instance == "b"
    assert region.pick(prefix=prefix, kv_bytes=4096 * MiB).instance == "a"  # none holds it: as if unsized
    # what dispatch and admission ask for: the prompt's KV in the region's dtype (1 KiB a token here)
    assert decode_instance(region, MODEL, 600 * 1024, prefix=prefix).instance == "b"
    assert decode_instance(region, MODEL, 50 * 1024, prefix=prefix).instance == "a"

    for instance in ("a", "b"):  # d-c: 3000 MiB free in all, 1500 MiB in each
        _join(reg, "d-c", instance, registry_pb2.Load(kv_free_bytes=1500 * MiB, decode_tokens_per_s=40.0))
    big = SHORT.model_copy(update={"prompt_tokens": 2000 * 1024 - 10, "allowed_regions": frozenset({"d-c"})})
    with pytest.raises(InsufficientCapacity):  # 2,000 MiB of KV (1 KiB a token): no instance holds it
        build_scheduler().decide(reg.snapshot(MODEL), big)


def test_a_regions_price_and_gpu_are_its_latest_registrations(registry: tuple[RegionRegistry, str]) -> None:
    """Two live instances registered with different prices and GPU types: the region's are those of the
    latest registration, whichever beats (before: the last to beat; the price flipped with every beat), of
    the latest live one once it dies."""
    reg, _address = registry
    tokens = {"a": _join(reg, "d-b", "a", usd_per_gpu_hour=2.0, gpu_type="H100")}
    tokens["b"] = _join(reg, "d-b", "b", usd_per_gpu_hour=9.0, gpu_type="H200")
    for instance in ("a", "b", "a"):
        request = registry_pb2.HeartbeatRequest(name="d-b", region_id=tokens[instance], instance=instance, load=ROOMY)
        assert not reg.heartbeat(request)
        region = reg.snapshot(MODEL).region("d-b")
        assert (region.usd_per_gpu_hour, region.gpu_type) == (9.0, "H200"), f"after {instance} beat"
    reg.redis.hset(reg.settings.key("instance", "d-b/b"), "last_beat_at", time.time() - 10)  # b died
    region = reg.snapshot(MODEL).region("d-b")
    assert (region.usd_per_gpu_hour, region.gpu_type) == (2.0, "H100")


def test_beats_are_stamped_and_aged_on_redis_clock(
    registry: tuple[RegionRegistry, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every API process and Celery worker stamps and ages beats on Redis's clock (TIME), not its own. (Before,
    a reader whose clock ran 4 s ahead of the process that took a 1 s-interval region's beat found it dead, and
    one 10 s behind stamped its beats and link estimates 10 s in the past.)"""
    reg, _address = registry
    reg.set_link(LINK)
    _join(reg, "pre", heartbeat_interval_s=1.0)
    _join(reg, "dec", heartbeat_interval_s=1.0)
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + 4.0)  # this host's clock, 4 s ahead
    assert reg.get("pre").alive and reg.snapshot(MODEL).region("dec").healthy
    monkeypatch.setattr(time, "time", lambda: real() - 10.0)  # 10 s behind: its beats are stamped as now
    _join(reg, "pre", heartbeat_interval_s=1.0, load=registry_pb2.Load(links=[link_report(2.0)]))
    monkeypatch.setattr(time, "time", real)
    assert reg.get("pre").instances[0].last_beat_at == pytest.approx(reg.clock(), abs=1.0)
    assert reg.link_estimates()[("pre", "dec")].updated_at == pytest.approx(reg.clock(), abs=1.0)


def test_admin_links_ages_the_estimates_on_redis_clock(
    registry: tuple[RegionRegistry, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """GET /admin/links (and the dashboard) show the link the scheduler sees, aged on the clock the estimates are
    stamped on. (Before, an API host 20 s ahead of Redis showed the estimate 20 s old and the link's senders
    quiet: 0 utilization where the scheduler used 0.2.)"""
    reg, _address = registry
    reg.set_link(LINK)
    _join(reg, "pre", heartbeat_interval_s=1.0, load=registry_pb2.Load(links=[link_report(2.0, backlogged=False)]))
    _join(reg, "dec", heartbeat_interval_s=1.0)
    (scheduled,) = [link for link in reg.links() if (link.src, link.dst) == ("pre", "dec")]
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + 20.0)  # this API host's clock, 20 s ahead of Redis's
    (view,) = list_links(SimpleNamespace(regions=reg, settings=reg.settings))  # type: ignore[arg-type]
    assert view.measured is not None and view.measured.age_s < 5
    assert view.scheduled.utilization == pytest.approx(scheduled.utilization) and scheduled.utilization > 0


def test_put_link_refuses_a_wrong_way_link_between_registered_regions_and_delete_removes_one(
    registry: tuple[RegionRegistry, str],
) -> None:
    """PUT /admin/links: a region not registered yet may be named (links are set before regions come up), but
    one from a decode region or to a prefill region is refused; DELETE removes a link (a typo stayed for good)."""
    reg, _address = registry
    reg.register(_registration("pre", "prefill", 1.0))
    reg.register(_registration("dec", "decode", 4.0))
    s = SimpleNamespace(regions=reg, settings=reg.settings)
    with pytest.raises(HTTPException) as info:
        put_link(LinkPublic(src="dec", dst="pre", rtt_ms=10, bandwidth_gbps=1), s)  # type: ignore[arg-type]
    assert info.value.status_code == 422
    assert str(info.value.detail).startswith("src: region 'dec' has role decode, not prefill/both")
    put_link(LinkPublic(src="nope", dst="dec", rtt_ms=10, bandwidth_gbps=1), s)  # type: ignore[arg-type]
    assert ("nope", "dec") in {(x.src, x.dst) for x in reg.configured_links()}
    delete_link("nope", "dec", s)  # type: ignore[arg-type]
    assert ("nope", "dec") not in {(x.src, x.dst) for x in reg.configured_links()}
    with pytest.raises(HTTPException) as gone:
        delete_link("nope", "dec", s)  # type: ignore[arg-type]
    assert (gone.value.status_code, gone.value.detail) == (404, "link not found")
    with pytest.raises(ValidationError):  # a region's name only: "a/b" made a link DELETE could not name
        LinkPublic(src="a/b", dst="dec", rtt_ms=10, bandwidth_gbps=1)


def test_links_come_back_from_the_database_when_redis_lost_them() -> None:
    """The operator's links are kept in the database too (fleet/link_rows.py): a Redis restarted empty gets them
    back at the next read (before, they were gone until someone PUT them again, and every split asked ran local
    with '0 split candidates'); a deleted link stays deleted."""
    from prfaas.control_plane.db.engine import make_engine
    from prfaas.control_plane.db.migrations import upgrade

    for settings in settings_fixture():
        client = redis.Redis.from_url(settings.redis_url)
        database = make_engine(settings.ledger.url)
        upgrade(settings.ledger.url, engine=database)
        try:
            reg = RegionRegistry(client, settings, database=database)
            kept, dropped = (LinkPublic(src="pre", dst=d, rtt_ms=10, bandwidth_gbps=1) for d in ("dec", "dec-2"))
            for link in (kept, dropped):
                put_link(link, SimpleNamespace(regions=reg))  # type: ignore[arg-type]
            delete_link("pre", "dec-2", SimpleNamespace(regions=reg))  # type: ignore[arg-type]
            client.delete(settings.key("links"))  # Redis restarted empty
            again = RegionRegistry(client, settings, database=database)  # another process, say
            assert [(x.src, x.dst) for x in again.configured_links()] == [("pre", "dec")]
            assert client.hkeys(settings.key("links")) == [b"pre>dec"]  # written back for every reader
            assert [(x.src, x.dst) for x in reg.configured_links()] == [("pre", "dec")]
        finally:
            database.dispose()
            client.close()
