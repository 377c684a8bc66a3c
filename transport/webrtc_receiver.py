"""The WebRTC receiver: a decode region's KV endpoint for senders that cannot reach it by TCP.

`answer(offer)` accepts a sender's peer connection; each data channel it opens is served by
the connection loop every receiver shares (transport/receiver_base.py), so the receiver rules are
TCP's.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from prfaas.transport.admission import REFUSED, ReceiverLimits
from prfaas.transport.errors import TransportError
from prfaas.transport.receiver_base import FrameConnection, ReceiverBase
from prfaas.transport.receiver_core import ReceiverCore
from prfaas.transport.tickets import TicketVerifier
from prfaas.transport.webrtc import (
    DataChannelStream,
    Description,
    EventLoopThread,
    IceServer,
    load_aiortc,
    rtc_configuration,
)

OPEN_WAIT_S = 30.0  # an answered offer's data channel must open within this, or its peer connection is closed


class WebRtcReceiver(ReceiverBase[FrameConnection]):
    """A decode region's KV endpoint over WebRTC: `answer(offer)` accepts a sender's peer
    connection (called by whatever carries signalling); its data channels are served like
    TCP connections."""

    def __init__(
        self,
        verifier: TicketVerifier,
        *,
        node: str = "receiver",
        ice_servers: tuple[IceServer, ...] = (),
        reap_interval_s: float = 0.05,
        limits: ReceiverLimits | None = None,
    ) -> None:
        self._ice_servers = ice_servers
        self._rtc = EventLoopThread(f"prfaas-webrtc-rx-{node}")
        # answered peer connections whose data channel has not opened (the loop's thread only): a sender that
        # vanished after signalling, or one that only sends offers, must not keep their sockets and ICE tasks
        self._waiting: dict[Any, None] = {}
        self._closing: set[asyncio.Future[Any]] = set()
        super().__init__(ReceiverCore(verifier, node), name="webrtc", reap_interval_s=reap_interval_s, limits=limits)

    def answer(self, offer: Description, timeout_s: float = 10.0) -> Description:
        """The SDP answer to a sender's offer. ValueError for a malformed offer."""
        if not isinstance(offer, dict) or offer.get("type") != "offer" or not isinstance(offer.get("sdp"), str):
            raise ValueError('an offer is {"type": "offer", "sdp": "..."}')
        if self._connections.closed.is_set():
            raise TransportError("receiver is closed")
        aiortc = load_aiortc()

        async def run() -> Description:
            pc = aiortc.RTCPeerConnection(configuration=rtc_configuration(self._ice_servers))
            pc.on("datachannel", lambda channel: self._accept(pc, channel))
            try:
                await pc.setRemoteDescription(aiortc.RTCSessionDescription(sdp=offer["sdp"], type="offer"))
                await pc.setLocalDescription(await pc.createAnswer())
            except BaseException:
                await pc.close()  # the offer is refused: nothing of it is kept
                raise
            if len(self._waiting) >= self.limits.max_unverified:
                # the oldest answered offer goes, as TCP evicts its oldest unverified connection: refusing the
                # new one would let a flood of offers lock out a real sender for OPEN_WAIT_S
                REFUSED.labels("evicted").inc()
                self._abandon(next(iter(self._waiting)))
            self._waiting[pc] = None
            asyncio.get_running_loop().call_later(OPEN_WAIT_S, self._abandon, pc)
            return {"type": pc.localDescription.type, "sdp": pc.localDescription.sdp}

        try:
            return self._rtc.run(run(), timeout_s)
        except (ValueError, AttributeError, AssertionError, KeyError, IndexError, TypeError) as exc:
            raise ValueError(f"bad SDP offer: {exc!r}") from None  # aiortc's SDP parser asserts and indexes

    def _accept(self, pc: Any, channel: Any) -> None:
        self._waiting.pop(pc, None)
        self.serve(FrameConnection(DataChannelStream(self._rtc, pc, channel), self.core, self.limits))

    def _abandon(self, pc: Any) -> None:
        """On the loop: close `pc` if its data channel never opened."""
        if self._waiting.pop(pc, 0) is None:
            task = asyncio.ensure_future(pc.close())
            self._closing.add(task)  # the loop keeps only a weak reference to a task
            task.add_done_callback(self._closing.discard)

    @property
    def num_waiting(self) -> int:
        """Answered offers whose data channel has not opened yet."""
        return len(self._waiting)

    def _release(self, timeout_s: float) -> None:
        async def close_waiting() -> None:
            waiting, self._waiting = list(self._waiting), {}
            await asyncio.gather(*(pc.close() for pc in waiting), return_exceptions=True)

        if not self._rtc.loop.is_closed():
            with contextlib.suppress(Exception):
                self._rtc.run(close_waiting(), timeout_s)
        self._rtc.close(timeout_s)
