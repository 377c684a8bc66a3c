"""The WebRTC sender: `TcpChannel`'s pool of streams, each stream one peer connection.

Frames, tickets, ACK / resend, deadlines and cancel are TCP's (transport/tcp_sender.py); only
the byte stream differs: `dial` (transport/webrtc.py) makes an offer, a `Signaller` carries
it to the receiver and brings back the answer, and the data channel that opens stands in for
a socket.
"""

from __future__ import annotations

from typing import Any

from prfaas.transport.tcp_sender import TcpChannel
from prfaas.transport.webrtc import EventLoopThread, IceServer, Signaller, dial


class WebRtcChannel(TcpChannel):
    """`TcpChannel` over WebRTC data channels to one receiver reached through `signal`.
    Implements `Channel`. `num_streams` peer connections (fixed: the adaptive controller
    reads TCP_INFO, which a data channel does not have)."""

    def __init__(
        self,
        signal: Signaller,
        *,
        peer: str = "webrtc",
        num_streams: int = 1,
        ice_servers: tuple[IceServer, ...] = (),
        connect_timeout_s: float = 10.0,
        unavailable_after_s: float = 15.0,
        **kwargs: Any,
    ) -> None:
        self._signal = signal
        self._ice_servers = ice_servers
        self._rtc = EventLoopThread(f"prfaas-webrtc-{peer}")
        super().__init__(
            (f"webrtc:{peer}", 0), num_streams=num_streams, connect_timeout_s=connect_timeout_s,
            unavailable_after_s=unavailable_after_s, dialer=self._dial, **kwargs,
        )  # fmt: skip

    def _dial(self, timeout_s: float) -> Any:
        return dial(self._rtc, self._signal, self._ice_servers, timeout_s)

    def close(self, timeout_s: float = 5.0) -> None:
        super().close(timeout_s)
        self._rtc.close(timeout_s)
