from __future__ import annotations

import os
import time
import uuid
from dataclasses import dataclass
from typing import NamedTuple

from prfaas.transport.api import Channel, Shipment, ShipmentSpec, Transfer
from prfaas.transport.inbound import Inbound, Receiver
from prfaas.transport.tickets import TicketSigner, TicketVerifier

KEY = os.urandom(32)


@dataclass
class Kit:
    signer: TicketSigner
    verifier: TicketVerifier

    def spec(
        self,
        *,
        num_layers: int = 6,
        shape: tuple[int, int, int] = (3, 512, 64),
        codec: str = "raw",
        timeout_s: float = 20.0,
        chunk_bytes: int = 64 << 10,
        attempt: int = 1,
        ticket: str | None = None,
        budget: int | None = None,
        job_id: str | None = None,
    ) -> ShipmentSpec:
        job_id = job_id or str(uuid.uuid4())
        raw = num_layers * 2 * shape[0] * shape[1] * shape[2] * 2
        if ticket is None:
            ticket = self.signer.issue(job_id, attempt, "acme", budget or raw, ttl_s=60)
        return ShipmentSpec(job_id, attempt, ticket, "bfloat16", (shape,) * num_layers, codec, timeout_s, chunk_bytes)


def layers_for(spec: ShipmentSpec, seed: int = 0) -> list[tuple[bytes, bytes]]:
    """Random bf16-sized bytes per layer (the transport never looks inside raw parts)."""
    rng = __import__("random").Random(seed)
    return [(rng.randbytes(spec.part_bytes(i)), rng.randbytes(spec.part_bytes(i))) for i in range(spec.num_layers)]


def fill(shipment: Shipment, layers: list[tuple[bytes, bytes]]) -> None:
    for index, (k, v) in enumerate(layers):
        shipment.add_layer(index, k, v)


class Shipped(NamedTuple):
    transfer: Transfer
    inbound: Inbound
    layers: list[tuple[bytes, bytes]]
    shipment: Shipment


def ship(
    channel: Channel,
    receiver: Receiver,
    spec: ShipmentSpec,
    *,
    num_filled: int | None = None,
    seed: int = 0,
    expect_timeout_s: float | None = None,
) -> Shipped:
    """Expect `spec` on `receiver` (for `expect_timeout_s`, by default the spec's timeout),
    submit it on `channel` and add its first `num_filled` layers (all by default)."""
    inbound = receiver.expect(spec.job_id, spec.attempt, timeout_s=expect_timeout_s or spec.timeout_s)
    layers = layers_for(spec, seed)
    shipment = Shipment(spec)
    transfer = channel.submit(shipment)
    fill(shipment, layers[:num_filled])
    return Shipped(transfer, inbound, layers, shipment)


def wait_until_sent(transfer: Transfer, timeout_s: float = 10.0) -> None:
    """Until the transfer has put bytes on the wire (asserts it did within `timeout_s`)."""
    deadline = time.monotonic() + timeout_s
    while transfer.stats.wire_bytes == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert transfer.stats.wire_bytes > 0, transfer.error
