"""Operations: Register and heartbeats to a test double of the registry (a real gRPC
server), /metrics, health and drain, config validation, generated stubs up to date."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from region_kit import KEY, IdleAgent, generate_tokens, local_region, new_job, reserve, split_generate, wait_until

from prfaas.engine.hf import HFEngine
from prfaas.engine.sampling import SamplingParams
from prfaas.protos.prfaas.v1 import decode_pb2, registry_pb2, registry_pb2_grpc
from prfaas.region.addresses import advertised_host
from prfaas.region.config import ConfigError, config_from_mapping, load_config
from prfaas.region.main import GIL_SWITCH_S, gil_switch_s
from prfaas.region.registry_client import Heartbeater
from prfaas.region.server import RegionServer
from prfaas.transport.endpoints import hostport
from prfaas.transport.identity import Identity
from prfaas.transport.tls import init_certs

GREEDY = SamplingParams(max_new_tokens=4, ignore_eos=True)


class FakeRegistry(registry_pb2_grpc.RegistryServicer):
    """Stands in for the control plane's registry (Control plane issue): records calls."""

    def __init__(self) -> None:
        self.registrations: list[registry_pb2.RegisterRequest] = []
        self.heartbeats: list[registry_pb2.HeartbeatRequest] = []
        self.forget = False  # answer the next heartbeat with reregister (a restarted registry)
        self.lock = threading.Lock()

    def Register(self, request: registry_pb2.RegisterRequest, context: object) -> registry_pb2.RegisterReply:
        with self.lock:
            self.registrations.append(request)
            return registry_pb2.RegisterReply(region_id=f"{request.name}-{len(self.registrations)}")

    def Heartbeat(self, request: registry_pb2.HeartbeatRequest, context: object) -> registry_pb2.HeartbeatReply:
        with self.lock:
            self.heartbeats.append(request)
            forget, self.forget = self.forget, False
        return registry_pb2.HeartbeatReply(reregister=forget)


def test_register_heartbeats_with_load_metrics_and_drain(tiny_engine: HFEngine) -> None:
    fake = FakeRegistry()
    registry = grpc.server(ThreadPoolExecutor(4))
    registry_pb2_grpc.add_RegistryServicer_to_server(fake, registry)
    port = registry.add_insecure_port("127.0.0.1:0")
    registry.start()
    registration = registry_pb2.RegisterRequest(name="both-a", role="both", kv_buffer_bytes=1 << 20)
    registered = (f"127.0.0.1:{port}", registration, 0.2)
    region = local_region(tiny_engine, metrics=True, kv_buffer_bytes=1 << 20, registry=registered)
    try:
        wait_until(lambda: len(fake.heartbeats) >= 3, 3.0)
        assert fake.registrations[0].name == "both-a"
        beat = fake.heartbeats[-1]
        assert beat.region_id == "both-a-1" and beat.load.kv_free_bytes == 1 << 20 and not beat.load.draining
        assert [b.seq for b in fake.heartbeats[:3]] == [1, 2, 3]

        reserve(region.decode_stub, held := new_job(), 4096)
        wait_until(lambda: fake.heartbeats[-1].load.kv_used_bytes == 4096, 2.0)
        fake.forget = True
        wait_until(lambda: len(fake.registrations) == 2, 2.0)  # asked to, it registers again

        ids = list(range(1, 40))
        split_generate(region.prefill_stub, region.decode_stub, ids, GREEDY, len(ids) * tiny_engine.kv_bytes_per_token)
        generate_tokens(region.decode_stub, ids, GREEDY)
        assert region.server.metrics_address is not None
        with urllib.request.urlopen(f"http://{region.server.metrics_address}/metrics", timeout=5) as response:
            text = response.read().decode()
        for name in (
            "prfaas_prefill_queue_depth", "prfaas_prefill_busy_workers", "prfaas_region_shipments_total",
            "prfaas_region_shipped_raw_bytes_total", "prfaas_region_shipped_wire_bytes_total",
            "prfaas_region_transfer_seconds_bucket", "prfaas_prefill_tokens_per_second",
            "prfaas_decode_tokens_per_second", "prfaas_decode_kv_used_bytes", "prfaas_decode_kv_free_bytes",
            "prfaas_kv_transfers_total", "prfaas_decode_local_prefill_tokens_per_second",
        ):  # fmt: skip
            assert f"\n{name}" in text, name
        # a local request measures what local prefill costs here (the scheduler compares it with a split)
        local_rate = next(line for line in text.splitlines() if line.startswith("prfaas_decode_local_prefill_tokens"))
        assert float(local_rate.split()[-1]) > 0
        assert 'prfaas_region_shipments_total{kind="prefill",status="completed"}' in text

        health = health_pb2_grpc.HealthStub(region.channel)
        service = health_pb2.HealthCheckRequest(service="prfaas.v1.DecodeRegion")
        assert health.Check(service, timeout=5).status == health_pb2.HealthCheckResponse.SERVING
        drain = threading.Thread(target=region.server.drain, args=(5.0,))
        drain.start()
        wait_until(lambda: health.Check(service, timeout=5).status == health_pb2.HealthCheckResponse.NOT_SERVING, 2)
        with pytest.raises(grpc.RpcError) as info:
            reserve(region.decode_stub, new_job(), 10)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        wait_until(lambda: fake.heartbeats[-1].load.draining, 2.0)
        region.decode_stub.Release(decode_pb2.ReleaseRequest(job_id=held), timeout=5)
        drain.join(10)  # idle now: the drain ends and stops the server
        assert not drain.is_alive()
    finally:
        region.close()
        registry.stop(0)


def test_heartbeats_survive_a_registry_that_is_down(tiny_engine: HFEngine) -> None:
    start = time.monotonic()
    region = local_region(tiny_engine, prefill=False, registry=("127.0.0.1:1", registry_pb2.RegisterRequest(), 0.1))
    try:
        time.sleep(0.4)
        assert region.server.heartbeater is not None and region.server.heartbeater.region_id == ""
        assert generate_tokens(region.decode_stub, [1, 2, 3], GREEDY)  # serving regardless
        assert time.monotonic() - start < 5
    finally:
        region.close()


def test_a_stopping_regions_last_heartbeat_says_draining_after_its_health_does() -> None:
    """`stop()` (SIGINT, or the end of a drain) sends one last beat: it must say draining, and the region's
    health must say NOT_SERVING by then. Before, a region stopped without a drain sent `draining: false` in it
    and the registry counted it healthy for its next heartbeat_misses intervals."""
    seen: list[tuple[bool, int]] = []  # each beat: (load.draining, the region's health as the beat arrives)

    class Registry(FakeRegistry):
        def Heartbeat(self, request: registry_pb2.HeartbeatRequest, context: object) -> registry_pb2.HeartbeatReply:
            health = health_pb2_grpc.HealthStub(grpc.insecure_channel(region.grpc_address))
            seen.append((request.load.draining, health.Check(health_pb2.HealthCheckRequest(), timeout=5).status))
            return super().Heartbeat(request, context)

    registry = grpc.server(ThreadPoolExecutor(4))
    registry_pb2_grpc.add_RegistryServicer_to_server(Registry(), registry)
    port = registry.add_insecure_port("127.0.0.1:0")
    registry.start()
    region = RegionServer("127.0.0.1:0", {"prfaas.v1.DecodeRegion": (IdleAgent(), lambda agent, server: None)})
    try:
        region.start((f"127.0.0.1:{port}", registry_pb2.RegisterRequest(name="dec-a", role="decode"), 0.2))
        wait_until(lambda: len(seen) >= 2, 5)
        region.stop()
        serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
        assert seen[0] == (False, serving) and seen[-1] == (True, not_serving), seen
        assert (True, serving) not in seen, seen  # never draining while the region's health says SERVING
    finally:
        region.stop(0)
        registry.stop(0)


def test_the_last_heartbeat_waits_for_the_one_in_flight() -> None:
    """A beat may take longer than stop() waits for the heartbeat thread (a slow registry): the last beat must
    not run beside it (before, the two shared `seq` and the registration token unguarded)."""
    in_flight = [0, 0]  # beats in the registry now, at most
    seqs: list[int] = []
    slow = threading.Event()
    lock = threading.Lock()

    class Registry(FakeRegistry):
        def Heartbeat(self, request: registry_pb2.HeartbeatRequest, context: object) -> registry_pb2.HeartbeatReply:
            with lock:
                in_flight[0] += 1
                in_flight[1] = max(in_flight)
                seqs.append(request.seq)
            if request.seq == 2:
                slow.set()
                threading.Event().wait(1.0)  # longer than stop() waits for the thread (two intervals)
            with lock:
                in_flight[0] -= 1
            return super().Heartbeat(request, context)

    registry = grpc.server(ThreadPoolExecutor(4))
    registry_pb2_grpc.add_RegistryServicer_to_server(Registry(), registry)
    port = registry.add_insecure_port("127.0.0.1:0")
    registry.start()
    beater = Heartbeater(f"127.0.0.1:{port}", registry_pb2.RegisterRequest(name="dec-a"), registry_pb2.Load, 0.2)
    try:
        beater.start()
        assert slow.wait(5)
        beater.stop()
        assert seqs == [1, 2, 3] and in_flight[1] == 1
    finally:
        registry.stop(0)


def test_a_register_the_registry_refuses_is_an_error_every_time(caplog: pytest.LogCaptureFixture) -> None:
    """INVALID_ARGUMENT or PERMISSION_DENIED to Register is the region's configuration (a price, a certificate),
    not an outage: each refusal is logged at error level with the registry's reason. Before, a warning at the
    1st, 10th and every 60th failure said only the code."""

    class Refusing(FakeRegistry):
        def Register(self, request: registry_pb2.RegisterRequest, context: grpc.ServicerContext) -> None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "usd_per_gpu_hour must be a finite number >= 0")

    registry = grpc.server(ThreadPoolExecutor(2))
    registry_pb2_grpc.add_RegistryServicer_to_server(Refusing(), registry)
    port = registry.add_insecure_port("127.0.0.1:0")
    registry.start()
    beater = Heartbeater(f"127.0.0.1:{port}", registry_pb2.RegisterRequest(name="dec-a"), registry_pb2.Load, 0.05)

    def refusals() -> list[logging.LogRecord]:
        return [r for r in caplog.records if r.levelname == "ERROR" and "finite number" in r.getMessage()]

    try:
        with caplog.at_level(logging.ERROR, logger="prfaas.region.registry_client"):
            beater.start()
            wait_until(lambda: len(refusals()) >= 3, 10)
    finally:
        beater.stop()
        registry.stop(0)
    assert "refuses to register this instance" in refusals()[0].getMessage()


VALID = {"name": "dec-a", "role": "decode", "ticket_key": KEY.decode()}


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"role": "prefil"}, "role"),
        ({"workers": 0}, "workers"),
        ({"kv_buffer_bytes": "lots"}, "kv_buffer_bytes"),
        ({"listen": {"kv": "7400"}}, "listen.kv"),
        ({"listen": {"grpc": "host:99999"}}, "listen.grpc"),
        ({"ticket_key": "short"}, "ticket_key"),
        ({"usd_per_gpu_hour": -1}, "usd_per_gpu_hour"),
        ({"engine": "sglang"}, "engine"),
        ({"engine": "vllm", "shm": True}, "(top level)"),  # vLLM regions ship KV over TCP only
        ({"engine": "vllm", "vllm": {"start_timeout_s": 0}}, "vllm.start_timeout_s"),
        ({"vllm": {"pyhton": "/usr/bin/python3"}}, "vllm.pyhton"),
        ({"vllm": {"ship": "sometimes"}}, "vllm.ship"),
        ({"engine_cpus": [4096]}, "engine_cpus"),
        ({"engine_cpus": []}, "engine_cpus"),
        ({"engine": "vllm", "engine_cpus": [0]}, "(top level)"),  # vLLM's cores: vllm.cpu_threads_bind
        ({"name": "Bad Name"}, "name"),
        ({"colour": "blue"}, "colour"),
        ({"control_plane_url": "grpc://nowhere"}, "control_plane_url"),
        ({"control_plane_url": "cp.example:0"}, "control_plane_url"),  # port 0 listens anywhere, dials nowhere
        ({"advertise": "10.0.0.5:50051"}, "advertise"),  # registered as [10.0.0.5:50051]:50051 before
        ({"advertise": "http://10.0.0.5"}, "advertise"),
        ({"advertise": "bad host name"}, "advertise"),
        ({"advertise": "0.0.0.0"}, "advertise"),  # a wildcard: what advertise is there to replace
        ({"advertise": "[::]"}, "advertise"),
        # `inf` is a number in YAML: the registry refused every Register of an infinite price, quietly
        ({"usd_per_gpu_hour": float("inf")}, "usd_per_gpu_hour"),
        ({"drain_timeout_s": float("inf")}, "drain_timeout_s"),  # a drain that never ends
        ({"drain_timeout_s": 7200}, "drain_timeout_s"),
        ({"max_reservation_s": float("inf")}, "max_reservation_s"),
        ({"max_reservation_s": 7200}, "max_reservation_s"),
        ({"kv_lease_s": float("inf")}, "kv_lease_s"),
        ({"kv_lease_s": float("nan")}, "kv_lease_s"),
        ({"heartbeat_interval_s": 1e-9}, "heartbeat_interval_s"),  # the heartbeat thread spun
        ({"heartbeat_interval_s": 61}, "heartbeat_interval_s"),  # more than the registry accepts
        ({"vllm": {"kv_cache_gib": float("inf")}}, "vllm.kv_cache_gib"),
        ({"kv_buffer_bytes": "9" * 400 + " GiB"}, "kv_buffer_bytes"),  # read as inf: OverflowError, no field
        ({"ticket_key": "x" * 40}, "(top level)"),  # a placeholder secret outside dev
    ],
)
def test_malformed_config_error_names_the_field(change: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError) as info:
        config_from_mapping(VALID | change, "region.yaml")
    assert f"\n  {field}: " in str(info.value)


@pytest.mark.parametrize(
    ("advertise", "endpoint"),
    [("10.0.0.5", "10.0.0.5:50051"), ("dec-a.internal", "dec-a.internal:50051"),
     ("2001:db8::5", "[2001:db8::5]:50051"), ("[2001:db8::5]", "[2001:db8::5]:50051")],
)  # fmt: skip
def test_advertise_is_a_host_that_becomes_a_dialable_endpoint(advertise: str, endpoint: str) -> None:
    config = config_from_mapping(VALID | {"advertise": advertise})
    assert hostport(advertised_host(config), 50051) == endpoint


def test_config_sizes_env_and_roles(monkeypatch: pytest.MonkeyPatch) -> None:
    config = config_from_mapping(VALID | {"kv_buffer_bytes": "2GiB", "control_plane_url": "grpc://cp:7000"})
    assert config.kv_buffer_bytes == 2 << 30 and config.control_plane_url == "cp:7000"
    assert config.identity.serves_decode and not config.identity.serves_prefill
    monkeypatch.setenv("PRFAAS_LISTEN__GRPC", "0.0.0.0:9000")
    monkeypatch.setenv("PRFAAS_INSECURE", "true")
    assert config_from_mapping(VALID).listen.grpc == "0.0.0.0:9000"


@pytest.fixture(scope="module")
def tls_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("certs")
    issue = {"dec-a-1": "prfaas://decode/dec-a/1", "dec-a-all": "prfaas://decode/dec-a/*",
             "pre-b-1": "prfaas://prefill/pre-b/1"}  # fmt: skip
    init_certs(directory, list(issue), ["127.0.0.1"], identities={n: Identity.parse(u) for n, u in issue.items()})
    return directory


def _tls(directory: Path, node: str) -> dict[str, str]:
    return {"ca": str(directory / "ca.pem"), "cert": str(directory / f"{node}.pem"),
            "key": str(directory / f"{node}-key.pem")}  # fmt: skip


def test_a_region_off_loopback_needs_tls_or_says_it_is_insecure(tls_dir: Path) -> None:
    exposed = VALID | {"listen": {"grpc": "0.0.0.0:9000", "kv": "10.0.0.5:7400"}, "instance": "1"}
    with pytest.raises(ConfigError, match=r"listen.grpc, listen.kv not on loopback without tls"):
        config_from_mapping(exposed)
    assert config_from_mapping(exposed | {"insecure": True}).tls is None
    assert config_from_mapping(exposed | {"tls": _tls(tls_dir, "dec-a-1")}).tls is not None
    shared = config_from_mapping(exposed | {"instance": "i-0abc", "tls": _tls(tls_dir, "dec-a-all")})
    assert shared.tls is not None and shared.tls.identity.instance == "*"  # an auto-scaling group's


@pytest.mark.parametrize(
    ("node", "instance", "error"),
    [
        ("pre-b-1", "1", "tls.cert is for prfaas://prefill/pre-b/1, this is prfaas://decode/dec-a/1"),
        ("dec-a-1", "2", "tls.cert is for prfaas://decode/dec-a/1, this is prfaas://decode/dec-a/2"),
    ],
)
def test_a_certificate_for_another_region_or_instance_is_refused(
    tls_dir: Path, node: str, instance: str, error: str
) -> None:
    with pytest.raises(ConfigError, match=error):
        config_from_mapping(VALID | {"instance": instance, "tls": _tls(tls_dir, node)})


def test_unreadable_or_identityless_tls_material_is_refused(tls_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"tls\.key: cannot read"):
        config_from_mapping(VALID | {"tls": _tls(tls_dir, "dec-a-1") | {"key": str(tmp_path / "absent.pem")}})
    init_certs(tmp_path, ["plain"], ["127.0.0.1"])
    with pytest.raises(ConfigError, match="names no prfaas identity"):
        config_from_mapping(VALID | {"tls": _tls(tmp_path, "plain") | {"ca": str(tls_dir / "ca.pem")}})


def test_prfaas_region_with_malformed_config_exits_naming_the_field(tmp_path: Path) -> None:
    path = tmp_path / "region.yaml"
    path.write_text(f"name: dec-a\nrole: decode\nticket_key: {KEY.decode()}\nlisten:\n  kv: nowhere\n")
    with pytest.raises(ConfigError, match=r"listen\.kv"):
        load_config(path)
    result = subprocess.run(
        [sys.executable, "-m", "prfaas.cli.main", "region", "--config", str(path)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2
    assert "listen.kv: 'nowhere' is not host:port" in result.stdout
    missing = subprocess.run(
        [sys.executable, "-m", "prfaas.cli.main", "region", "--config", str(tmp_path / "absent.yaml")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert missing.returncode == 2 and "cannot read the region config" in missing.stdout


def test_vllm_region_without_the_vllm_environment_exits_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "region.yaml"
    path.write_text(f"name: dec-v\nrole: decode\nengine: vllm\nmodel: tiny-llama\nticket_key: {KEY.decode()}\n"
                    "vllm:\n  python: /nonexistent/python\n")  # fmt: skip
    assert load_config(path).vllm.python == "/nonexistent/python"
    result = subprocess.run(
        [sys.executable, "-m", "prfaas.cli.main", "region", "--config", str(path)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    message = " ".join(result.stdout.split())  # the console wraps long lines
    assert result.returncode == 2, result.stdout + result.stderr
    assert "cannot start region dec-v" in message and "/nonexistent/python is not an executable file" in message
    assert "make vllm-install" in message


def test_generated_stubs_match_the_protos() -> None:
    result = subprocess.run([sys.executable, "-m", "prfaas.protos.generate", "--check"], capture_output=True, text=True,
                            timeout=60)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr


def test_health_watch_churn_does_not_stall_the_server() -> None:
    """Health Watch streams opened and cancelled from many threads while unary calls go on.
    grpcio-health-checking's non-blocking servicer sends a Watch's first reply holding its
    lock and waits for the server's completion-queue thread, which may be waiting for that
    lock to run another Watch's close callback: the whole server stalled (the up/down wedge)."""
    server = RegionServer("127.0.0.1:0", {})
    server.start()
    channel = grpc.insecure_channel(server.grpc_address)
    stub = health_pb2_grpc.HealthStub(channel)
    stop = threading.Event()
    errors: list[BaseException] = []

    def churn() -> None:
        try:
            while not stop.is_set():
                call = stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=10)
                next(call)
                call.cancel()
        except BaseException as exc:
            if not stop.is_set():
                errors.append(exc)

    threads = [threading.Thread(target=churn, daemon=True) for _ in range(8)]
    for thread in threads:
        thread.start()
    try:
        deadline = time.monotonic() + 6.0
        checks = 0
        while time.monotonic() < deadline and not errors:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=3)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            checks += 1
        assert not errors, errors[0]
        assert checks > 10
    finally:
        stop.set()
        for thread in threads:
            thread.join(15)
        channel.close()
        server.stop(0)
    assert not any(thread.is_alive() for thread in threads)


def test_a_region_accepts_tickets_signed_with_the_keys_it_is_told_to_accept(monkeypatch: pytest.MonkeyPatch) -> None:
    new_key = "rotated-ticket-key-0123456789abcdefghij"
    monkeypatch.setenv("PRFAAS_TICKET_KEYS_ACCEPTED", json.dumps({"k2": new_key}))
    config = config_from_mapping(VALID)
    assert config.ticket_keys == {"k1": KEY, "k2": new_key.encode()}
    with pytest.raises(ConfigError, match=r"ticket_keys_accepted.k3 is shorter than 32 characters"):
        config_from_mapping(VALID | {"ticket_keys_accepted": {"k3": "short"}})


def test_a_region_serves_on_an_ipv6_address() -> None:
    """`[::1]:0` binds (grpc binds no bare v6 address: the brackets were dropped) and the addresses recorded
    are `[v6]:port`, which the region's own parsers read back."""
    server = RegionServer("[::1]:0", {}, metrics_address="[::1]:0")
    try:
        assert server.grpc_address.startswith("[::1]:") and server.metrics_address is not None
        assert server.metrics_address.startswith("[::1]:")
        server.start()
        with grpc.insecure_channel(server.grpc_address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        with urllib.request.urlopen(f"http://{server.metrics_address}/metrics", timeout=10) as page:
            assert page.status == 200
    finally:
        server.stop()


def test_a_second_server_on_a_port_in_use_is_refused_naming_the_address() -> None:
    """Two region processes given the same listen.grpc: grpcio's default SO_REUSEPORT let the second bind too,
    and the kernel split connections between them. With it off, the second is OSError naming the address."""
    first = RegionServer("127.0.0.1:0", {})
    try:
        with pytest.raises(OSError, match=rf"cannot listen for gRPC on {first.grpc_address}"):
            RegionServer(first.grpc_address, {}).stop(0)
    finally:
        first.stop(0)


@pytest.mark.parametrize(
    ("value", "expected"),
    [(None, GIL_SWITCH_S), ("0.001", 0.001), ("0.1", 0.1),
     ("abc", None), ("0", None), ("-0.001", None), ("nan", None), ("1e10", None), ("", None)],
)  # fmt: skip
def test_the_gil_switch_interval_is_a_small_positive_number(value: str | None, expected: float | None) -> None:
    environ = {} if value is None else {"PRFAAS_GIL_SWITCH_S": value}
    if expected is not None:
        assert gil_switch_s(environ) == expected
        return
    with pytest.raises(ValueError, match=r"PRFAAS_GIL_SWITCH_S must be a number in \(0, 0.1\]"):
        gil_switch_s(environ)


def test_prfaas_region_with_a_bad_gil_switch_interval_exits_naming_it(tmp_path: Path) -> None:
    """Before, `abc` failed with float()'s message and `0` with setswitchinterval's, neither naming the variable."""
    path = tmp_path / "region.yaml"
    path.write_text(f"name: dec-a\nrole: decode\nticket_key: {KEY.decode()}\n")
    result = subprocess.run(
        [sys.executable, "-m", "prfaas.cli.main", "region", "--config", str(path)],
        capture_output=True, text=True, timeout=60, env=os.environ | {"PRFAAS_GIL_SWITCH_S": "abc"},
    )  # fmt: skip
    message = " ".join(result.stdout.split())  # the console wraps long lines
    assert result.returncode == 2, result.stdout + result.stderr
    assert "PRFAAS_GIL_SWITCH_S must be a number in (0, 0.1]: 'abc'" in message
