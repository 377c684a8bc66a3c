"""What the KV connector's scheduler side hands its worker side each step (`PrfaasMetadata`: the requests to
ship and to load, with their blocks), and the worker's record of one shipment in flight (`Outbound`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from prfaas.engine.staging import StagedShipment
from prfaas.engine.vllm.params import LoadParams, ShipParams
from prfaas.transport.api import Shipment, ShipmentSpec, Transfer


@dataclass(frozen=True)
class ShipJob:
    req_id: str
    params: ShipParams
    block_ids: tuple[int, ...]
    num_tokens: int  # prompt tokens shipped


@dataclass(frozen=True)
class LoadJob:
    req_id: str
    params: LoadParams
    block_ids: tuple[int, ...]
    start_token: int  # tokens before it are already cached locally (block-aligned)
    num_tokens: int  # prompt tokens the shipment must cover


@dataclass
class PrfaasMetadata(KVConnectorMetadata):
    ships: list[ShipJob] = field(default_factory=list)
    loads: list[LoadJob] = field(default_factory=list)


@dataclass(eq=False)
class Outbound:
    """One request's shipment while its layers are being computed and sent."""

    job: ShipJob
    spec: ShipmentSpec
    transfer: Transfer
    shipment: Shipment
    layers_added: set[int] = field(default_factory=set)
    staged: StagedShipment | None = None  # KV in GPU memory: each layer staged to host (engine/staging.py)
