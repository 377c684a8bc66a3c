"""The region registry's gRPC service (protos/prfaas/v1/registry.proto): `Register`, `Heartbeat` into the
`RegionRegistry`, and the WebRTC signalling calls (`Signal`, `Offers`, `Answer`) through the `SignalRelay`.
Served by the API process when `registry_listen` is set (control_plane/app.py).

With mutual TLS (`Settings.tls`) only regions may call (region/authz.py), and each only about itself: an
instance registers and beats only as the region, role and instance its certificate names (a certificate for
`*` may speak for any instance of its region), and reads and answers only the WebRTC offers addressed to its region.
Anyone else gets PERMISSION_DENIED before the registry is touched, so the real instance's record stands."""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc

from prfaas.control_plane.fleet.records import DEFAULT_INSTANCE
from prfaas.control_plane.fleet.registry import RegionRegistry
from prfaas.control_plane.fleet.signaling import SignalQueueFull, SignalRelay
from prfaas.protos.prfaas.v1 import registry_pb2, registry_pb2_grpc
from prfaas.region.authz import Authorizer, peer_identity, registry_policy
from prfaas.region.channels import SERVER_OPTIONS, TlsFiles
from prfaas.region.channels import listen as bind

# Signalling calls that hold a thread while they wait (a region's Offers stream, a sender's Signal for up to 30 s)
# at once; past it RESOURCE_EXHAUSTED. The server's pool has this many threads more than Register and Heartbeat
# need, so webrtc regions never starve the heartbeats of the fleet.
MAX_SIGNAL_CALLS = 64
THREADS = 16 + MAX_SIGNAL_CALLS
# One caller's Signal calls waiting at once (with TLS, a region's; else a host's): no region can take every slot.
# A quarter of the slots are the Offers streams' alone, so senders never keep a region from its offers.
MAX_SIGNALS_PER_CALLER = 8
OFFER_MARGIN_S = 1.0  # an Offers call takes no offer this close to its deadline (a one-way trip must fit in it)


class RegistryServicer(registry_pb2_grpc.RegistryServicer):
    def __init__(self, registry: RegionRegistry, tls: bool = False) -> None:
        self.registry = registry
        self.relay = SignalRelay(registry.redis, registry.settings)
        self.tls = tls  # callers then carry identities, checked against what they say of themselves
        self._signal_calls = threading.BoundedSemaphore(MAX_SIGNAL_CALLS)
        self._lock = threading.Lock()
        self._senders: collections.Counter[str] = collections.Counter()  # caller -> its Signal calls waiting

    @contextlib.contextmanager
    def _signal_slot(self, context: grpc.ServicerContext) -> Iterator[None]:
        if not self._signal_calls.acquire(blocking=False):
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{MAX_SIGNAL_CALLS} signalling calls wait already")
        try:
            yield
        finally:
            self._signal_calls.release()

    @contextlib.contextmanager
    def _sender_slot(self, context: grpc.ServicerContext) -> Iterator[None]:
        """A Signal call's slot: only a region that can send KV may offer (with TLS), at most
        MAX_SIGNALS_PER_CALLER of a caller at once, and never the Offers streams' quarter of the slots."""
        caller = peer_identity(context) if self.tls else None
        if self.tls and (caller is None or caller.kind not in ("prefill", "both")):
            context.abort(grpc.StatusCode.PERMISSION_DENIED, f"{caller} sends no KV: it may not offer a connection")
        key = caller.region if caller is not None else context.peer().rsplit(":", 1)[0]
        with self._lock:
            waiting = sum(self._senders.values())
            if waiting >= MAX_SIGNAL_CALLS - MAX_SIGNAL_CALLS // 4 or self._senders[key] >= MAX_SIGNALS_PER_CALLER:
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"signalling calls of {key} or of all wait already")
            self._senders[key] += 1
        try:
            with self._signal_slot(context):
                yield
        finally:
            with self._lock:
                self._senders[key] -= 1
                if self._senders[key] <= 0:
                    del self._senders[key]

    def _speaks_for(
        self, context: grpc.ServicerContext, region: str, *, role: str | None = None, instance: str | None = None
    ) -> None:
        if not self.tls:
            return
        caller = peer_identity(context)
        wrong = (
            caller is None or caller.region != region or (role is not None and caller.kind != role)
            or (instance is not None and caller.instance not in ("*", instance or DEFAULT_INSTANCE))
        )  # fmt: skip
        if wrong:
            named = "*" if instance is None else instance or DEFAULT_INSTANCE
            what = f"prfaas://{role or '*'}/{region}/{named}"
            context.abort(grpc.StatusCode.PERMISSION_DENIED, f"{caller} may not speak for {what}")

    def Register(  # noqa: N802 (the name the .proto gives it)
        self, request: registry_pb2.RegisterRequest, context: grpc.ServicerContext
    ) -> registry_pb2.RegisterReply:
        self._speaks_for(context, request.name, role=request.role, instance=request.instance)
        try:
            return registry_pb2.RegisterReply(region_id=self.registry.register(request))
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            raise AssertionError("unreachable") from exc

    def Heartbeat(  # noqa: N802
        self, request: registry_pb2.HeartbeatRequest, context: grpc.ServicerContext
    ) -> registry_pb2.HeartbeatReply:
        self._speaks_for(context, request.name, instance=request.instance)
        return registry_pb2.HeartbeatReply(reregister=self.registry.heartbeat(request))

    def Signal(  # noqa: N802
        self, request: registry_pb2.SignalRequest, context: grpc.ServicerContext
    ) -> registry_pb2.SignalReply:
        try:
            with self._sender_slot(context):
                sdp = self.relay.signal(request.region, request.offer_sdp, request.timeout_s or 10.0)
        except SignalQueueFull as exc:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
            raise AssertionError("unreachable") from exc
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
        self._speaks_for(context, request.region)
        with self._signal_slot(context):
            # No offer is taken in the call's last OFFER_MARGIN_S (a quarter of a short call): one sent then would
            # reach the region after its deadline and be lost; the call ends OK and the region opens the next.
            margin_s = min(OFFER_MARGIN_S, context.time_remaining() / 4)
            while context.is_active() and (wait_s := context.time_remaining() - margin_s) > 0:
                offer = self.relay.next_offer(request.region, wait_s)
                if offer is None:
                    continue
                if not context.is_active():  # the stream ended while we waited: its region never saw the offer
                    self.relay.put_back(request.region, offer)
                    return
                sent = False
                try:
                    yield registry_pb2.SignalOffer(id=offer.id, offer_sdp=offer.sdp)
                    sent = True  # gRPC asks for the next reply only once this one went out on a live stream
                finally:
                    if not sent:
                        self.relay.put_back(request.region, offer)

    def Answer(  # noqa: N802
        self, request: registry_pb2.SignalAnswer, context: grpc.ServicerContext
    ) -> registry_pb2.AnswerReply:
        """Only the region an offer is addressed to may answer it; an answer to an offer no one waits for any
        more (answered, or its sender gave up) is dropped."""
        try:
            self.relay.check_answer(request.id, request.answer_sdp, request.error)
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            raise AssertionError("unreachable") from exc
        region = self.relay.addressee(request.id)
        if region is not None:
            self._speaks_for(context, region)
            self.relay.answer(request.id, request.answer_sdp, request.error)
        return registry_pb2.AnswerReply()


def serve_registry(registry: RegionRegistry, listen: str, tls: TlsFiles | None = None) -> tuple[grpc.Server, str]:
    """Start the Registry gRPC service on `listen` (port 0 picks one), with mutual TLS when `tls`
    is given; returns it and its address."""
    server = grpc.server(
        ThreadPoolExecutor(THREADS, thread_name_prefix="prfaas-registry"), options=SERVER_OPTIONS,
        interceptors=[Authorizer(registry_policy)] if tls is not None else None,
    )  # fmt: skip
    registry_pb2_grpc.add_RegistryServicer_to_server(RegistryServicer(registry, tls is not None), server)
    host = listen.rsplit(":", 1)[0]
    port = bind(server, listen, tls)
    server.start()
    return server, f"{host}:{port}"
