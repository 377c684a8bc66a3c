"""Where a prefill job ships its KV: the decode region's endpoint, the ticket it must
present, and the codec; parsed from the request and checked (`InvalidRequest` names the field)."""

from __future__ import annotations

from dataclasses import dataclass

from prfaas.protos.prfaas.v1 import prefill_pb2
from prfaas.region.errors import InvalidRequest
from prfaas.transport.codecs import CODEC_NAMES, get_codec
from prfaas.transport.endpoints import Endpoint, choose, parse_endpoints
from prfaas.transport.errors import CodecError


@dataclass(frozen=True)
class Destination:
    address: Endpoint  # the fastest of the decode region's endpoints usable from here
    ticket: str
    codec: str
    endpoints: tuple[Endpoint, ...] = ()  # all the decode region offered, in its order
    kv_endpoint: str = ""  # as the request wrote them
    decode_region: str = ""  # its name: the TLS server name its KV port presents
    num_streams: int = 0  # the scheduler's stream count for the path (a new channel starts there); 0: default

    @staticmethod
    def parse(msg: prefill_pb2.Destination, default_codec: str) -> Destination:
        try:
            endpoints = parse_endpoints(msg.kv_endpoint)
            address = choose(endpoints)
        except ValueError as exc:
            raise InvalidRequest(f"destination.kv_endpoint: {exc}") from None
        if not msg.ticket:
            raise InvalidRequest("destination.ticket is required (signed by the control plane)")
        codec = msg.codec or default_codec
        try:
            get_codec(codec)
        except (CodecError, ValueError, KeyError):
            raise InvalidRequest(f"destination.codec {codec!r} is not one of {', '.join(CODEC_NAMES)}") from None
        if msg.num_streams > 256:
            raise InvalidRequest(f"destination.num_streams {msg.num_streams} is over 256")
        return Destination(address, msg.ticket, codec, endpoints, msg.kv_endpoint, msg.decode_region, msg.num_streams)
