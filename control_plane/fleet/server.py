"""The region registry's gRPC service (protos/prfaas/v1/registry.proto): `Register`, `Heartbeat` into the
`RegionRegistry`, and the WebRTC signalling calls (`Signal`, `Offers`, `Answer`) through the `SignalRelay`.
Served by the API process when `registry_listen` is set (control_plane/app.py)."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc

from prfaas.control_plane.fleet.registry import RegionRegistry
from prfaas.control_plane.fleet.signaling import SignalRelay
from prfaas.protos.prfaas.v1 import registry_pb2, registry_pb2_grpc
from prfaas.region.channels import SERVER_OPTIONS


class RegistryServicer(registry_pb2_grpc.RegistryServicer):
    def __init__(self, registry: RegionRegistry) -> None:
        self.registry = registry
        self.relay = SignalRelay(registry.redis, registry.settings)

    def Register(  # noqa: N802 (the name the .proto gives it)
        self, request: registry_pb2.RegisterRequest, context: grpc.ServicerContext
    ) -> registry_pb2.RegisterReply:
        try:
            return registry_pb2.RegisterReply(region_id=self.registry.register(request))
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            raise AssertionError("unreachable") from exc

    def Heartbeat(  # noqa: N802
        self, request: registry_pb2.HeartbeatRequest, context: grpc.ServicerContext
    ) -> registry_pb2.HeartbeatReply:
        return registry_pb2.HeartbeatReply(reregister=self.registry.heartbeat(request))

    def Signal(  # noqa: N802
        self, request: registry_pb2.SignalRequest, context: grpc.ServicerContext
    ) -> registry_pb2.SignalReply:
        try:
            sdp = self.relay.signal(request.region, request.offer_sdp, request.timeout_s or 10.0)
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            raise AssertionError("unreachable") from exc
        except TimeoutError as exc:
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(exc))
            raise AssertionError("unreachable") from exc
        return registry_pb2.SignalReply(answer_sdp=sdp)

    def Offers(  # noqa: N802
        self, request: registry_pb2.OffersRequest, context: grpc.ServicerContext
    ) -> Iterator[registry_pb2.SignalOffer]:
        if not request.region:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "region is required")
        while context.is_active():
            offer = self.relay.next_offer(request.region)
            if offer is not None:
                yield registry_pb2.SignalOffer(id=offer[0], offer_sdp=offer[1])

    def Answer(  # noqa: N802
        self, request: registry_pb2.SignalAnswer, context: grpc.ServicerContext
    ) -> registry_pb2.AnswerReply:
        if not request.id:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "id is required")
        self.relay.answer(request.id, request.answer_sdp, request.error)
        return registry_pb2.AnswerReply()


def serve_registry(registry: RegionRegistry, listen: str) -> tuple[grpc.Server, str]:
    """Start the Registry gRPC service on `listen` (port 0 picks one); returns it and its address."""
    server = grpc.server(ThreadPoolExecutor(8, thread_name_prefix="prfaas-registry"), options=SERVER_OPTIONS)
    registry_pb2_grpc.add_RegistryServicer_to_server(RegistryServicer(registry), server)
    host = listen.rsplit(":", 1)[0]
    port = server.add_insecure_port(listen)
    if port == 0:
        raise OSError(f"cannot listen on {listen}")
    server.start()
    return server, f"{host}:{port}"
