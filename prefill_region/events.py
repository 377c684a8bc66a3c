"""A Prefill call's event stream, as the agent sends it: a shipment's `ShipmentComplete`, and the stages of the
job's prefill span (queued, the forward, the shipment) from its events as they pass."""

from __future__ import annotations

import time

from prfaas.prefill_region.backend import Shipped
from prfaas.protos.prfaas.v1 import prefill_pb2
from prfaas.telemetry import tracing


def stage_spans(span: tracing.Span, event: prefill_pb2.PrefillEvent, received_ns: int) -> None:
    """The stages of the job's prefill span, from its events as they pass: queued, the forward, the shipment."""
    now = time.time_ns()
    kind = event.WhichOneof("event")
    if kind == "started":
        tracing.span_at("prefill.queue", span, received_ns, now)
    elif kind == "prefill_done":
        done = event.prefill_done
        tracing.span_at("prefill.forward", span, now - int(done.prefill_s * 1e9), now,
                        {"prfaas.cached_tokens": done.cached_tokens})  # fmt: skip
    elif kind == "shipment_complete":
        shipped = event.shipment_complete
        tracing.span_at("prefill.ship", span, now - int(shipped.transfer_s * 1e9), now,
                        {"prfaas.raw_bytes": shipped.raw_bytes, "prfaas.wire_bytes": shipped.wire_bytes})  # fmt: skip


def shipment_complete(shipped: Shipped) -> prefill_pb2.ShipmentComplete:
    return prefill_pb2.ShipmentComplete(
        raw_bytes=shipped.raw_bytes, wire_bytes=shipped.wire_bytes, transfer_s=shipped.seconds
    )
