"""Transfer tickets: HMAC-signed permission to ship one job attempt's KV to a receiver.

Format (docs/wire-format.md): `base64url(claims JSON) "." base64url(HMAC-SHA256)`.
The control plane issues them (`TicketSigner.issue`); a decode region verifies them
(`TicketVerifier.verify`) before it stores any KV, and remembers each used nonce until
the ticket expires so a ticket cannot open a second shipment (`ReplayGuard`).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import math
import secrets
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import asdict, dataclass

from prfaas.transport.errors import TicketRejected

TICKET_VERSION = 1
MIN_KEY_BYTES = 32


@dataclass(frozen=True)
class Ticket:
    job: str  # job UUID
    attempt: int
    tenant: str
    budget: int  # most raw KV bytes the shipment may carry
    exp: float  # Unix seconds
    nonce: str
    kid: str
    v: int = TICKET_VERSION


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _well_typed(ticket: Ticket) -> bool:
    def whole(value: object) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    texts = (ticket.job, ticket.tenant, ticket.nonce, ticket.kid)
    number = whole(ticket.exp) or (isinstance(ticket.exp, float) and math.isfinite(ticket.exp))
    counts = (ticket.attempt, ticket.budget, ticket.v)
    return all(isinstance(t, str) for t in texts) and all(whole(c) for c in counts) and number


def _check_keys(keys: Mapping[str, bytes]) -> None:
    if not keys:
        raise ValueError("at least one ticket key is required")
    for kid, key in keys.items():
        if len(key) < MIN_KEY_BYTES:
            raise ValueError(f"ticket key {kid!r} is {len(key)} bytes; at least {MIN_KEY_BYTES} are required")


class TicketSigner:
    """Issues tickets with the key `active_kid` of `keys` (kid -> secret, >= 32 bytes)."""

    def __init__(self, keys: Mapping[str, bytes], active_kid: str) -> None:
        _check_keys(keys)
        if active_kid not in keys:
            raise ValueError(f"active ticket key {active_kid!r} is not among the keys {sorted(keys)}")
        self._keys = dict(keys)
        self._kid = active_kid

    def issue(self, job: str, attempt: int, tenant: str, budget: int, ttl_s: float, now: float | None = None) -> str:
        uuid.UUID(job)  # job ids are UUIDs on the wire; fail here, not at the receiver
        claims = Ticket(
            job=job, attempt=attempt, tenant=tenant, budget=budget,
            exp=(time.time() if now is None else now) + ttl_s, nonce=secrets.token_hex(16), kid=self._kid,
        )  # fmt: skip
        body = json.dumps(asdict(claims), sort_keys=True, separators=(",", ":")).encode()
        mac = hmac.new(self._keys[self._kid], body, hashlib.sha256).digest()
        return f"{_b64(body)}.{_b64(mac)}"


class TicketVerifier:
    """Checks signature, expiry and what the ticket names. Holds current and previous keys."""

    def __init__(self, keys: Mapping[str, bytes]) -> None:
        _check_keys(keys)
        self._keys = dict(keys)

    def verify(self, token: str, *, job: str, attempt: int, now: float | None = None) -> Ticket:
        try:
            body_b64, mac_b64 = token.split(".")
            body, mac = _unb64(body_b64), _unb64(mac_b64)
            claims = json.loads(body)
            ticket = Ticket(**claims)
        except (ValueError, TypeError, RecursionError) as exc:  # RecursionError: JSON nested past the parser's depth
            raise TicketRejected(f"malformed ticket: {exc}") from None
        if not _well_typed(ticket):  # before any claim is used: a peer's JSON may put a list where a key id goes
            raise TicketRejected("malformed ticket: a claim has the wrong type")
        key = self._keys.get(ticket.kid)
        if key is None:
            raise TicketRejected(f"ticket signed with unknown key {ticket.kid!r}")
        if not hmac.compare_digest(mac, hmac.new(key, body, hashlib.sha256).digest()):
            raise TicketRejected("ticket signature is invalid")
        if ticket.v != TICKET_VERSION:
            raise TicketRejected(f"ticket version {ticket.v} not supported")
        if (time.time() if now is None else now) >= ticket.exp:
            raise TicketRejected("ticket expired")
        if ticket.job != job or ticket.attempt != attempt:
            raise TicketRejected(
                f"ticket is for job {ticket.job} attempt {ticket.attempt}, not job {job} attempt {attempt}"
            )
        return ticket


class ReplayGuard:
    """Remembers the nonces of finished shipments until their tickets expire."""

    def __init__(self) -> None:
        self._used: dict[str, float] = {}  # nonce -> expiry (Unix s)
        self._lock = threading.Lock()

    def check(self, ticket: Ticket) -> None:
        with self._lock:
            if ticket.nonce in self._used:
                raise TicketRejected("ticket replayed: it already opened a shipment that has ended")

    def retire(self, ticket: Ticket, now: float | None = None) -> None:
        now = time.time() if now is None else now
        with self._lock:
            self._used[ticket.nonce] = ticket.exp
            for nonce in [n for n, exp in self._used.items() if exp <= now]:
                del self._used[nonce]
