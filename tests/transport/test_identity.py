"""Node identities in certificates (transport/identity.py): what `prfaas certs init` writes and
what authorization reads back."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from cryptography import x509

from prfaas.transport.identity import Identity, IdentityError, identity_of
from prfaas.transport.tls import init_certs


@pytest.mark.parametrize(
    ("uri", "kind", "region", "instance"),
    [
        ("prfaas://prefill/prefill-a/i-0abc", "prefill", "prefill-a", "i-0abc"),
        ("prfaas://decode/decode-scarce/host1.example", "decode", "decode-scarce", "host1.example"),
        ("prfaas://both/local/1", "both", "local", "1"),
        ("prfaas://control-plane/prod", "control-plane", "prod", ""),
        ("prfaas://prefill/prefill-a/*", "prefill", "prefill-a", "*"),  # shared by an auto-scaling group
    ],
)
def test_identities_round_trip(uri: str, kind: str, region: str, instance: str) -> None:
    identity = Identity.parse(uri)
    assert (identity.kind, identity.region, identity.instance) == (kind, region, instance)
    assert identity.uri == uri


@pytest.mark.parametrize(
    ("uri", "error"),
    [
        ("https://prefill/a/1", "not a prfaas:// identity"),
        ("prfaas://prefill/a", "instance ''"),  # a region instance must name itself
        ("prfaas://control-plane/prod/1", "names no instance"),
        ("prfaas://admin/prod", "kind 'admin'"),
        ("prfaas://prefill/Bad_Name/1", "not a region name"),
        ("prfaas://prefill/a/1/2", "expected prfaas://KIND/NAME[/INSTANCE]"),
        ("prfaas://prefill/a/../x", "expected"),
    ],
)
def test_malformed_identities_are_refused_naming_the_part(uri: str, error: str) -> None:
    with pytest.raises(IdentityError, match=error.replace("[", r"\[").replace("]", r"\]")):
        Identity.parse(uri)


def test_roles_of_an_identity() -> None:
    both = Identity.parse("prfaas://both/r/1")
    assert both.serves_prefill and both.serves_decode and both.is_region and not both.is_control_plane
    assert not Identity.parse("prfaas://decode/r/1").serves_prefill
    assert Identity.parse("prfaas://control-plane/cp").is_control_plane


def test_certificates_carry_the_identity_they_were_issued_for(tmp_path: Path) -> None:
    prefill = Identity.parse("prfaas://prefill/prefill-a/i-1")
    _ca, (node, plain) = init_certs(tmp_path, ["p1", "plain"], ["127.0.0.1"], identities={"p1": prefill})
    assert identity_of(node.cert.read_bytes()) == prefill
    names = (
        x509.load_pem_x509_certificate(node.cert.read_bytes())
        .extensions.get_extension_for_class(x509.SubjectAlternativeName)
        .value.get_values_for_type(x509.DNSName)
    )
    assert "prefill-a.region.prfaas" in names  # what callers check instead of the address they dial
    assert identity_of(plain.cert.read_bytes()) is None  # no identity: refused wherever one is required
    with pytest.raises(ValueError, match="nodes not issued: ghost"):
        init_certs(tmp_path, ["p2"], ["127.0.0.1"], identities={"ghost": prefill})


def test_certs_init_cli_issues_one_node_per_identity(tmp_path: Path) -> None:
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "prfaas.cli.main", "certs", "init", "--dir", str(tmp_path), *args]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)

    ok = run("--name", "cp", "--identity", "prfaas://control-plane/prod", "--san", "10.0.0.2")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert identity_of((tmp_path / "cp.pem").read_bytes()) == Identity("control-plane", "prod")
    two = run("--name", "a", "--name", "b", "--identity", "prfaas://control-plane/prod")
    assert two.returncode == 2 and "exactly one --name" in two.stdout
    bad = run("--name", "x", "--identity", "prfaas://prefill/x")
    assert bad.returncode == 2 and "instance" in bad.stdout
