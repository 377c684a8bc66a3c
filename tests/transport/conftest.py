import pytest
from transport_kit import KEY, Kit

from prfaas.transport.tickets import TicketSigner, TicketVerifier


@pytest.fixture
def kit() -> Kit:
    return Kit(TicketSigner({"k1": KEY}, "k1"), TicketVerifier({"k1": KEY}))
