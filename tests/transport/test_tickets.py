import base64
import uuid

import pytest

from prfaas.transport.errors import TicketRejected
from prfaas.transport.tickets import ReplayGuard, TicketSigner, TicketVerifier

KEY = b"k" * 32
JOB = str(uuid.UUID(int=42))
NOW = 1_800_000_000.0


def issue(signer: TicketSigner | None = None, **kw: object) -> str:
    args: dict[str, object] = {"job": JOB, "attempt": 1, "tenant": "acme", "budget": 1 << 20, "ttl_s": 60, "now": NOW}
    args.update(kw)
    return (signer or TicketSigner({"k1": KEY}, "k1")).issue(**args)  # type: ignore[arg-type]


def test_valid_ticket_verifies_and_names_its_claims() -> None:
    ticket = TicketVerifier({"k1": KEY}).verify(issue(), job=JOB, attempt=1, now=NOW + 1)
    assert (ticket.job, ticket.attempt, ticket.tenant, ticket.budget, ticket.exp) == (JOB, 1, "acme", 1 << 20, NOW + 60)


def test_forged_signature_is_rejected() -> None:
    forged = issue(TicketSigner({"k1": b"x" * 32}, "k1"))
    with pytest.raises(TicketRejected, match="signature is invalid"):
        TicketVerifier({"k1": KEY}).verify(forged, job=JOB, attempt=1, now=NOW)


def test_edited_claims_are_rejected() -> None:
    body, mac = issue().split(".")
    import base64
    import json

    claims = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
    claims["budget"] = 1 << 40
    edited = base64.urlsafe_b64encode(json.dumps(claims).encode()).rstrip(b"=").decode()
    with pytest.raises(TicketRejected, match="signature is invalid"):
        TicketVerifier({"k1": KEY}).verify(f"{edited}.{mac}", job=JOB, attempt=1, now=NOW)


def test_expired_ticket_is_rejected() -> None:
    with pytest.raises(TicketRejected, match="expired"):
        TicketVerifier({"k1": KEY}).verify(issue(), job=JOB, attempt=1, now=NOW + 60)


def test_ticket_for_another_job_or_attempt_is_rejected() -> None:
    verifier = TicketVerifier({"k1": KEY})
    with pytest.raises(TicketRejected, match="not job"):
        verifier.verify(issue(), job=str(uuid.UUID(int=43)), attempt=1, now=NOW)
    with pytest.raises(TicketRejected, match=r"attempt 1, not job .* attempt 2"):
        verifier.verify(issue(), job=JOB, attempt=2, now=NOW)


def test_rotated_keys_verify_old_and_new() -> None:
    verifier = TicketVerifier({"k1": KEY, "k2": b"n" * 32})
    verifier.verify(issue(), job=JOB, attempt=1, now=NOW)
    verifier.verify(issue(TicketSigner({"k2": b"n" * 32}, "k2")), job=JOB, attempt=1, now=NOW)
    with pytest.raises(TicketRejected, match="unknown key 'k1'"):
        TicketVerifier({"k2": b"n" * 32}).verify(issue(), job=JOB, attempt=1, now=NOW)


DEEP = base64.urlsafe_b64encode(b"[" * 5000).rstrip(b"=").decode() + ".AAAA"  # nested past json's depth


@pytest.mark.parametrize("token", ["", "abc", "a.b.c", "!!!.???", "e30.AAAA", DEEP])
def test_malformed_tickets_are_rejected(token: str) -> None:
    with pytest.raises(TicketRejected):
        TicketVerifier({"k1": KEY}).verify(token, job=JOB, attempt=1, now=NOW)


def test_short_keys_are_refused_at_start() -> None:
    with pytest.raises(ValueError, match="at least 32 are required"):
        TicketVerifier({"k1": b"short"})


def test_replay_guard_refuses_a_retired_nonce_until_expiry() -> None:
    guard = ReplayGuard()
    verifier = TicketVerifier({"k1": KEY})
    first = verifier.verify(issue(), job=JOB, attempt=1, now=NOW)  # exp = NOW + 60
    guard.check(first)
    guard.retire(first, now=NOW)
    with pytest.raises(TicketRejected, match="replayed"):
        guard.check(first)
    # A retirement 1 s before `first` expires forgets nothing: `first` is still refused.
    early = verifier.verify(issue(now=NOW + 59), job=JOB, attempt=1, now=NOW + 59)  # exp = NOW + 119
    guard.retire(early, now=NOW + 59)
    with pytest.raises(TicketRejected, match="replayed"):
        guard.check(first)
    # A retirement at `first`'s expiry forgets it (the verifier refuses it as expired from then on, so the
    # guard need not remember it); the younger `early` is still remembered.
    second = verifier.verify(issue(now=NOW + 60), job=JOB, attempt=1, now=NOW + 60)  # exp = NOW + 120
    guard.retire(second, now=NOW + 60)
    guard.check(first)
    for live in (early, second):
        with pytest.raises(TicketRejected, match="replayed"):
            guard.check(live)


def test_replay_guard_remembers_only_unexpired_nonces() -> None:
    # 200 shipments back to back, each ticket living 60 s and each retired when the one before it expires:
    # at the end only the last is remembered, so the guard's memory stays bounded by the live tickets.
    guard = ReplayGuard()
    verifier = TicketVerifier({"k1": KEY})
    tickets = []
    for i in range(200):
        at = NOW + 60 * i
        ticket = verifier.verify(issue(now=at), job=JOB, attempt=1, now=at)
        guard.retire(ticket, now=at)
        tickets.append(ticket)
    for old in tickets[:-1]:
        guard.check(old)
    with pytest.raises(TicketRejected, match="replayed"):
        guard.check(tickets[-1])
