"""WebRTC signalling through the control plane's registry (registry.proto Signal / Offers /
Answer), for `transport: webrtc` regions. Both ends only dial out to the control plane.

Sender (prefill region): `signaller(target, region)` is the `Signaller` a `WebRtcChannel`
calls with its offer. Receiver (decode region): `OfferListener` takes the offers addressed to
it from the Offers stream, answers each with the receiver and posts the answer. Every call
has a deadline; a control plane that is down costs a retry per second, never a hang.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc

from prfaas.protos.prfaas.v1 import registry_pb2, registry_pb2_grpc
from prfaas.region.channels import TlsFiles, channel, replies
from prfaas.region.registry_client import control_plane_options
from prfaas.transport.identity import server_name

log = logging.getLogger(__name__)
Description = dict[str, str]
STREAM_S = 60.0  # one Offers call's deadline
RETRY_S = 1.0  # Offers calls at most one per this


def signaller(target: str, region: str, tls: TlsFiles | None = None) -> Callable[[Description, float], Description]:
    stub = registry_pb2_grpc.RegistryStub(channel(target, tls, server_name(None)))

    def signal(offer: Description, timeout_s: float) -> Description:
        request = registry_pb2.SignalRequest(region=region, offer_sdp=offer["sdp"], timeout_s=timeout_s)
        try:
            reply = stub.Signal(request, timeout=timeout_s + 2)
        except grpc.RpcError as exc:
            raise ConnectionError(f"signalling {region} through {target}: {exc.code().name} {exc.details()}") from None
        return {"type": "answer", "sdp": reply.answer_sdp}

    return signal


class OfferListener:
    """Answers offers for `region` with `answer(offer, timeout_s) -> answer` until `stop`.

    The Offers stream is what a silent loss of the control plane (host gone, a partition, a NAT
    dropping the flow: no FIN, no RST) would leave waiting forever, so its channel has keepalive
    (`interval_s`, the region's heartbeat interval: such a loss is noticed within an interval and
    max(2 s, an interval), region/channels.py `keepalive_options`), and
    each call a deadline of `stream_s`, after which the next call opens (the registry ends a call
    before its deadline, keeping the offers it has not sent). At most one call per RETRY_S."""

    def __init__(
        self,
        target: str,
        region: str,
        answer: Callable[[Description, float], Description],
        tls: TlsFiles | None = None,
        *,
        interval_s: float = 1.0,
        stream_s: float = STREAM_S,
    ) -> None:
        self.region = region
        self.stream_s = stream_s
        self._answer = answer
        self._channel = channel(target, tls, server_name(None), control_plane_options(interval_s))
        self._stub = registry_pb2_grpc.RegistryStub(self._channel)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._call: Any = None  # the Offers stream while open (cancel() ends it)
        self._thread = threading.Thread(target=self._loop, name="prfaas-webrtc-offers", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                with self._lock:
                    if self._stop.is_set():
                        return
                    self._call = call = self._stub.Offers(
                        registry_pb2.OffersRequest(region=self.region), timeout=self.stream_s
                    )
                for offer in replies(call):  # not `for offer in call`: that can hang on an ended call
                    self._reply(offer)
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED and not self._stop.is_set():
                    log.warning("offers stream for %s broke (%s); again in %g s", self.region, exc.code().name,
                                RETRY_S)  # fmt: skip
            self._stop.wait(RETRY_S - (time.monotonic() - started))  # a call that lasted RETRY_S: the next at once

    def _reply(self, offer: registry_pb2.SignalOffer) -> None:
        try:
            answer = self._answer({"type": "offer", "sdp": offer.offer_sdp}, 10.0)
            reply = registry_pb2.SignalAnswer(id=offer.id, answer_sdp=answer["sdp"])
        except Exception as exc:  # whatever one offer raises is that offer's answer, not the listener's end
            if not isinstance(exc, ValueError | TimeoutError | OSError):
                log.warning("offer %s: %r", offer.id, exc)
            reply = registry_pb2.SignalAnswer(id=offer.id, error=str(exc) or type(exc).__name__)
        try:
            self._stub.Answer(reply, timeout=5)
        except grpc.RpcError as exc:
            log.warning("posting the answer to offer %s failed: %s", offer.id, exc.code().name)

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            call = self._call
        if call is not None:
            call.cancel()
        self._thread.join(5)
        self._channel.close()
