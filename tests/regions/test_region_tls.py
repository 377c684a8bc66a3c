"""Mutual TLS on a region's gRPC services (region/authz.py): only the control plane's
certificate may drive a region; a peer region may watch its health; a caller without a
certificate from the deployment's CA does not get past the handshake. Nothing is reserved
by a refused call. Real gRPC servers and certificates from `init_certs`."""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Iterator
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc
from region_kit import KEY, IdleAgent, Region, local_region, new_job

from prfaas.engine.hf import HFEngine
from prfaas.protos.prfaas.v1 import decode_pb2, decode_pb2_grpc
from prfaas.region.channels import TlsFiles, channel
from prfaas.region.config import ConfigError, RegionConfig, config_from_mapping
from prfaas.region.health import MAX_WATCHES_PER_CALLER
from prfaas.region.server import RegionServer
from prfaas.transport.identity import Identity, server_name
from prfaas.transport.tls import init_certs

IDENTITIES = {
    "cp": "prfaas://control-plane/prod",
    "tls-a": "prfaas://both/tls-a/1",
    "pre-b": "prfaas://prefill/pre-b/1",
    "dec-c": "prfaas://decode/dec-c/*",
}


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TlsFiles]:
    folder = tmp_path_factory.mktemp("pki")
    identities = {name: Identity.parse(uri) for name, uri in IDENTITIES.items()}
    init_certs(folder, list(identities), ["127.0.0.1"], identities=identities)
    init_certs(folder / "other", ["cp"], ["127.0.0.1"], identities={"cp": identities["cp"]})  # another CA
    files = {name: _files(folder, name) for name in identities}
    files["stranger"] = _files(folder / "other", "cp")
    return files


def _files(folder: Path, name: str) -> TlsFiles:
    return TlsFiles(ca=str(folder / "ca.pem"), cert=str(folder / f"{name}.pem"), key=str(folder / f"{name}-key.pem"))


@pytest.fixture(scope="module")
def region(tiny_engine: HFEngine, pki: dict[str, TlsFiles]) -> Iterator[Region]:
    found = local_region(tiny_engine, name="tls-a", tls=pki["tls-a"].model_dump(), kv_buffer_bytes=1 << 20)
    yield found
    found.close()


def _stub(region: Region, tls: TlsFiles | None, name: str = "tls-a") -> decode_pb2_grpc.DecodeRegionStub:
    return decode_pb2_grpc.DecodeRegionStub(channel(region.server.grpc_address, tls, server_name(name)))


def _reserve(region: Region, tls: TlsFiles | None, name: str = "tls-a", job_id: str = "") -> decode_pb2.ReserveReply:
    request = decode_pb2.ReserveRequest(job_id=job_id or new_job(), attempt=1, tenant="acme", kv_bytes=1000, ttl_s=30)
    reply: decode_pb2.ReserveReply = _stub(region, tls, name).Reserve(request, timeout=5)
    return reply


def _code(call: object) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        call()  # type: ignore[operator]
    return info.value.code()


def test_the_control_planes_certificate_drives_the_region(region: Region, pki: dict[str, TlsFiles]) -> None:
    job_id = new_job()
    reply = _reserve(region, pki["cp"], job_id=job_id)
    assert reply.free_bytes == (1 << 20) - 1000
    assert region.decode is not None and region.decode.book.used_bytes == 1000
    assert _stub(region, pki["cp"]).Release(decode_pb2.ReleaseRequest(job_id=job_id), timeout=5).found
    assert region.decode.book.used_bytes == 0


def test_a_prefill_regions_certificate_may_not_reserve(region: Region, pki: dict[str, TlsFiles]) -> None:
    with pytest.raises(grpc.RpcError) as info:
        _reserve(region, pki["pre-b"])
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "prfaas://prefill/pre-b/1 may not call /prfaas.v1.DecodeRegion/Reserve" in (info.value.details() or "")
    assert region.decode is not None and region.decode.book.used_bytes == 0  # nothing reserved


@pytest.mark.parametrize("who", ["plaintext", "stranger"])
def test_callers_without_a_certificate_of_the_deployment_do_not_get_in(
    region: Region, pki: dict[str, TlsFiles], who: str
) -> None:
    assert _code(lambda: _reserve(region, pki.get(who))) == grpc.StatusCode.UNAVAILABLE  # the handshake fails
    assert region.decode is not None and region.decode.book.used_bytes == 0


def test_a_server_that_is_not_the_region_dialled_is_refused(region: Region, pki: dict[str, TlsFiles]) -> None:
    assert _code(lambda: _reserve(region, pki["cp"], name="decode-elsewhere")) == grpc.StatusCode.UNAVAILABLE


def test_peer_regions_may_watch_its_health(region: Region, pki: dict[str, TlsFiles]) -> None:
    stub = health_pb2_grpc.HealthStub(channel(region.server.grpc_address, pki["pre-b"], server_name("tls-a")))
    reply = stub.Check(health_pb2.HealthCheckRequest(service="prfaas.v1.DecodeRegion"), timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_a_peer_region_cannot_take_the_threads_the_control_plane_needs(pki: dict[str, TlsFiles]) -> None:
    """Each health Watch holds a thread while open; a peer region may hold MAX_WATCHES_PER_CALLER at once, and
    watches have threads of their own. Before, one region's certificate could open a Watch per thread of the
    region's pool, and the control plane's calls (Cancel, Prefill, Reserve) waited until their deadline."""
    region = RegionServer("127.0.0.1:0", {"prfaas.v1.PrefillRegion": (IdleAgent(), lambda agent, server: None)},
                          max_rpc_threads=4, tls=pki["tls-a"])  # fmt: skip
    region.start()

    def health(who: str) -> health_pb2_grpc.HealthStub:
        return health_pb2_grpc.HealthStub(channel(region.grpc_address, pki[who], server_name("tls-a")))

    everything = health_pb2.HealthCheckRequest()
    streams = [health("pre-b").Watch(everything) for _ in range(4 + MAX_WATCHES_PER_CALLER)]
    readers = ThreadPoolExecutor(len(streams))
    firsts = [readers.submit(_first_reply, stream) for stream in streams]
    try:
        done, _ = futures.wait(firsts, timeout=5)  # before, those past the pool's threads waited for one
        assert health("cp").Check(everything, timeout=3).status == health_pb2.HealthCheckResponse.SERVING
        outcomes = [first.result() for first in done]
        assert len(outcomes) == len(streams) and outcomes.count("watching") == MAX_WATCHES_PER_CALLER, outcomes
        assert set(outcomes) == {"watching", grpc.StatusCode.RESOURCE_EXHAUSTED}, outcomes
        other = health("dec-c").Watch(everything, timeout=5)  # another region still watches
        assert _first_reply(other) == "watching"
        other.cancel()
    finally:
        for stream in streams:
            stream.cancel()
        readers.shutdown()
        region.stop(0)


def _first_reply(stream: grpc.Call) -> str | grpc.StatusCode:
    try:
        reply = next(stream)  # type: ignore[call-overload]
    except grpc.RpcError as exc:
        return exc.code()
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    return "watching"


def _issue(
    folder: Path, name: str, uri: str | None, issuer: str = "ca", *, days: tuple[int, int] = (-1, 30), ca: bool = False
) -> None:
    """`name`.pem and `name`-key.pem, signed by `issuer`.pem's key: what `init_certs` cannot make (an expired
    certificate, an intermediate CA)."""
    issuer_cert = x509.load_pem_x509_certificate((folder / f"{issuer}.pem").read_bytes())
    issuer_key = serialization.load_pem_private_key((folder / f"{issuer}-key.pem").read_bytes(), password=None)
    assert isinstance(issuer_key, ec.EllipticCurvePrivateKey)
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(issuer_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now + datetime.timedelta(days=days[0]))
        .not_valid_after(now + datetime.timedelta(days=days[1]))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if uri is not None:
        san = [x509.UniformResourceIdentifier(uri), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
        builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
    cert = builder.sign(issuer_key, hashes.SHA256())
    (folder / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    (folder / f"{name}-key.pem").write_bytes(key_pem)


def _config(tls: dict[str, str]) -> RegionConfig:
    return config_from_mapping({"name": "tls-a", "role": "both", "instance": "1", "ticket_key": KEY.decode(),
                                "tls": tls})  # fmt: skip


@pytest.mark.parametrize(
    ("change", "error"),
    [
        ({"key": "garbage.pem"}, "tls.key: not an unencrypted PEM private key"),
        ({"key": "cp-key.pem"}, "tls.key: not the key of tls.cert"),  # another certificate's key
        ({"ca": "garbage.pem"}, "tls.ca: holds no PEM certificate"),
        ({"key": "absent.pem"}, "tls.key: cannot read .*absent.pem: No such file"),
        ({"ca": "other/ca.pem"}, "tls.cert: not issued by a CA in tls.ca"),  # a bundle of another deployment's CA
        ({"cert": "expired.pem", "key": "expired-key.pem"}, r"tls.cert: valid from .* to .* UTC, not now"),
    ],
)
def test_tls_material_that_cannot_work_is_refused_when_the_config_loads(
    pki: dict[str, TlsFiles], change: dict[str, str], error: str
) -> None:
    """Before, only readability was checked: the region loaded its engine, then failed to bind (a bad key, the
    message blaming the address) or started and failed every handshake (another CA's certificate)."""
    folder = Path(pki["cp"].ca).parent
    (folder / "garbage.pem").write_text("this is not a PEM key\n")
    _issue(folder, "expired", "prfaas://both/tls-a/1", days=(-30, -1))
    with pytest.raises(ConfigError, match=error):
        _config(pki["tls-a"].model_dump() | {k: str(folder / v) for k, v in change.items()})


def test_a_ca_bundle_and_an_intermediate_chain_are_accepted(pki: dict[str, TlsFiles], tmp_path: Path) -> None:
    """A rotation's bundle (another CA beside this certificate's) and a certificate file that carries its
    intermediate CA after it both verify, as they do in the TLS handshake."""
    folder = Path(pki["cp"].ca).parent
    bundle = tmp_path / "bundle.pem"
    bundle.write_bytes((folder / "other" / "ca.pem").read_bytes() + (folder / "ca.pem").read_bytes())
    assert _config(pki["tls-a"].model_dump() | {"ca": str(bundle)}) is not None
    _issue(folder, "intermediate", None, ca=True)
    _issue(folder, "leaf", "prfaas://both/tls-a/1", issuer="intermediate")
    chain = tmp_path / "chain.pem"
    chain.write_bytes((folder / "leaf.pem").read_bytes() + (folder / "intermediate.pem").read_bytes())
    assert _config({"ca": str(folder / "ca.pem"), "cert": str(chain), "key": str(folder / "leaf-key.pem")}) is not None
    with pytest.raises(ConfigError, match=r"tls\.cert: not issued by a CA in tls\.ca"):  # the chain is what links it
        _config({"ca": str(folder / "ca.pem"), "cert": str(folder / "leaf.pem"), "key": str(folder / "leaf-key.pem")})
