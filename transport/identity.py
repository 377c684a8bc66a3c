"""Who is at the other end of a connection: the identity a node certificate names.

Every certificate `prfaas certs init` issues carries one URI in its subject alternative
names, besides the DNS names and addresses peers dial:

    prfaas://control-plane/NAME              the control plane (API processes, Celery workers)
    prfaas://prefill/REGION/INSTANCE         an instance of a prefill region
    prfaas://decode/REGION/INSTANCE          an instance of a decode region
    prfaas://both/REGION/INSTANCE            an instance of a region serving both roles

INSTANCE `*` is a certificate every instance of the region shares (an auto-scaling group's,
from a secret store): it proves the region, not which instance. Each certificate also names
its server name as a DNS SAN (`Identity.server_name`: `REGION.region.prfaas`,
`control-plane.prfaas`), which callers verify instead of the address they dial, so
instances whose addresses are not known in advance need no certificate of their own.

Authorization reads it (`identity_of` on the peer's certificate): a KV receiver accepts
only prefill-capable peers; a region's services accept control calls only from the control
plane; the registry accepts a region's `Register` only from a certificate naming that region.
A certificate without such a URI has no identity and is refused where one is required.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from cryptography import x509

Kind = Literal["control-plane", "prefill", "decode", "both"]
KINDS: tuple[Kind, ...] = ("control-plane", "prefill", "decode", "both")
REGION_NAME = re.compile(r"[a-z0-9][a-z0-9-]{0,62}")  # a region name (region config `name`), fullmatch
INSTANCE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")  # an instance id within its region, fullmatch


class IdentityError(ValueError):
    """A URI that is not a prfaas identity; the message says which part is wrong."""


@dataclass(frozen=True)
class Identity:
    kind: Kind
    region: str  # the region's name; the control plane's deployment name
    instance: str = ""  # the instance's id within its region; "" for the control plane

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise IdentityError(f"kind {self.kind!r} is not one of {', '.join(KINDS)}")
        if not REGION_NAME.fullmatch(self.region):
            raise IdentityError(f"name {self.region!r} is not a region name (lowercase letters, digits, '-')")
        if self.kind == "control-plane":
            if self.instance:
                raise IdentityError("a control-plane identity names no instance")
        elif self.instance != "*" and not INSTANCE_ID.fullmatch(self.instance):  # "*": any instance of the region
            raise IdentityError(
                f"instance {self.instance!r} is not an instance id (letters, digits, '.', '_', '-'; or '*')"
            )

    @property
    def uri(self) -> str:
        tail = f"/{self.instance}" if self.instance else ""
        return f"prfaas://{self.kind}/{self.region}{tail}"

    @property
    def server_name(self) -> str:
        """The DNS name in the certificate that callers check (TLS server name)."""
        return server_name(None if self.is_control_plane else self.region)

    @property
    def is_control_plane(self) -> bool:
        return self.kind == "control-plane"

    @property
    def serves_prefill(self) -> bool:
        return self.kind in ("prefill", "both")

    @property
    def serves_decode(self) -> bool:
        return self.kind in ("decode", "both")

    @property
    def is_region(self) -> bool:
        return self.kind != "control-plane"

    @staticmethod
    def parse(uri: str) -> Identity:
        """`prfaas://KIND/NAME[/INSTANCE]` -> Identity; IdentityError otherwise."""
        scheme, sep, rest = uri.partition("://")
        if scheme != "prfaas" or not sep:
            raise IdentityError(f"{uri!r} is not a prfaas:// identity")
        parts = rest.split("/")
        if len(parts) not in (2, 3):
            raise IdentityError(f"{uri!r}: expected prfaas://KIND/NAME[/INSTANCE]")
        kind = parts[0]
        if kind not in KINDS:
            raise IdentityError(f"{uri!r}: kind {kind!r} is not one of {', '.join(KINDS)}")
        return Identity(kind, parts[1], parts[2] if len(parts) == 3 else "")

    def __str__(self) -> str:
        return self.uri


def server_name(region: str | None) -> str:
    """The TLS server name of a region's instances (`region`), or of the control plane (None)."""
    return "control-plane.prfaas" if region is None else f"{region}.region.prfaas"


def identity_of(certificate: x509.Certificate | bytes) -> Identity | None:
    """The identity a certificate (object, PEM or DER bytes) names; None when it names none
    (or more than one, which `prfaas certs init` never issues)."""
    if isinstance(certificate, bytes):
        certificate = (
            x509.load_pem_x509_certificate(certificate)
            if certificate.lstrip().startswith(b"-----")
            else x509.load_der_x509_certificate(certificate)
        )
    try:
        san = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return None
    found = []
    for uri in san.get_values_for_type(x509.UniformResourceIdentifier):
        if uri.startswith("prfaas://"):
            try:
                found.append(Identity.parse(uri))
            except IdentityError:
                return None
    return found[0] if len(found) == 1 else None
