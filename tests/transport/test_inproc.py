"""The in-process transport: same frames, tickets and receiver rules as TCP, no sockets."""

import pytest
from transport_kit import Kit, fill, layers_for

from prfaas.transport.api import Shipment, TransferStatus
from prfaas.transport.errors import TicketRejected, TransferCanceled
from prfaas.transport.inproc import InProcessChannel, InProcessReceiver
from prfaas.transport.tickets import TicketSigner


@pytest.mark.parametrize("codec", ["raw", "lossless"])
def test_shipment_reassembles_bit_exactly(kit: Kit, codec: str) -> None:
    receiver = InProcessReceiver(kit.verifier)
    spec = kit.spec(codec=codec, num_layers=4, shape=(2, 300, 64))
    inbound = receiver.expect(spec.job_id, spec.attempt, timeout_s=10)
    layers = layers_for(spec)
    shipment = Shipment(spec)
    transfer = InProcessChannel(receiver).submit(shipment)
    assert transfer.status() is TransferStatus.IN_FLIGHT
    fill(shipment, layers)
    assert transfer.wait(5) is TransferStatus.COMPLETED
    assert inbound.wait(5) is TransferStatus.COMPLETED
    for index, (k, v) in enumerate(layers):
        assert inbound.layer(index, timeout_s=1) == (k, v)
    assert transfer.stats.raw_bytes == spec.raw_bytes
    assert receiver.core.num_expected == 0


def test_each_layer_is_exposed_as_soon_as_it_arrives(kit: Kit) -> None:
    receiver = InProcessReceiver(kit.verifier)
    spec = kit.spec(num_layers=3)
    inbound = receiver.expect(spec.job_id, spec.attempt, timeout_s=10)
    shipment = Shipment(spec)
    InProcessChannel(receiver).submit(shipment)
    layers = layers_for(spec)
    shipment.add_layer(0, *layers[0])
    assert inbound.layer(0, timeout_s=1) == layers[0]  # before layers 1 and 2 exist
    assert inbound.status() is TransferStatus.IN_FLIGHT


def test_forged_ticket_is_refused_before_any_kv_is_stored(kit: Kit) -> None:
    receiver = InProcessReceiver(kit.verifier)
    base = kit.spec()
    forged = TicketSigner({"k1": b"f" * 32}, "k1").issue(base.job_id, 1, "acme", base.raw_bytes, 60)
    spec = kit.spec(job_id=base.job_id, ticket=forged)
    inbound = receiver.expect(spec.job_id, spec.attempt, timeout_s=10)
    shipment = Shipment(spec)
    fill(shipment, layers_for(spec))
    transfer = InProcessChannel(receiver).submit(shipment)
    assert transfer.wait(1) is TransferStatus.FAILED
    assert isinstance(transfer.error, TicketRejected)
    assert inbound.info is None
    assert inbound.wire_bytes == 0


def test_sender_cancel_frees_the_receiver(kit: Kit) -> None:
    receiver = InProcessReceiver(kit.verifier)
    spec = kit.spec(num_layers=3)
    inbound = receiver.expect(spec.job_id, spec.attempt, timeout_s=10)
    shipment = Shipment(spec)
    transfer = InProcessChannel(receiver).submit(shipment)
    shipment.add_layer(0, *layers_for(spec)[0])
    transfer.cancel()
    assert transfer.status() is TransferStatus.CANCELED
    assert inbound.wait(1) is TransferStatus.CANCELED
    assert isinstance(inbound.error, TransferCanceled)
    with pytest.raises(TransferCanceled):
        inbound.layer(0, timeout_s=0.1)  # buffers dropped: a canceled shipment's KV is gone
    assert receiver.core.num_expected == 0
