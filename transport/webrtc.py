"""WebRTC data channels (aiortc) for a decode region that cannot accept inbound TCP: what
the sender (webrtc_sender.py) and the receiver (webrtc_receiver.py) share.

The TCP protocol unchanged, over another byte stream: each stream of a `WebRtcChannel` is
one RTCPeerConnection with one ordered, reliable data channel, wrapped as the blocking
socket-like object (`DataChannelStream`) that `TcpChannel` and the TCP receiver's
connection loop already drive. So frames, tickets, checksums, ACK / resend, deadlines and
cancel are exactly TCP's. How the peers meet: the sender makes an SDP offer, a `Signaller`
carries it to the receiver (`WebRtcReceiver.answer`) and brings back the answer; in a
deployment the control plane relays both (docs/transports.md). ICE uses host candidates,
plus the STUN / TURN servers passed in `ice_servers` (from configuration) and nothing else:
aiortc's default public STUN server is never used.

aiortc is imported only here, when a WebRTC object is built (extra `webrtc`). It runs in one
asyncio loop thread per channel or receiver; SCTP in pure Python costs about a core per
~10 MB/s, so this is the fallback for regions TCP cannot reach, not a fast path.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import threading
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

from prfaas.transport.errors import TransportError

T = TypeVar("T")
MESSAGE_BYTES = 64 << 10  # the largest message every WebRTC stack accepts (max-message-size default)
BUFFER_HIGH_BYTES = 4 << 20  # a sender waits while this much is queued in the data channel
# A data channel has no RST: a peer that died unnoticed is found when nothing of a full send
# buffer drains for this long (ICE consent freshness would take ~30 s).
STALL_S = 2.0
# aiortc hands every message to the app as it arrives (SCTP's window never waits on the reader), so
# received bytes the reader has not taken are capped: past this the reader is stalled and the stream
# is broken (closed, as a dead peer's), its unacknowledged chunks resent on another.
RECV_QUEUE_BYTES = 16 << 20
Description = dict[str, str]  # {"type": "offer" | "answer", "sdp": "..."}
Signaller = Callable[[Description, float], Description]  # (offer, timeout_s) -> answer


@dataclass(frozen=True)
class IceServer:
    """A STUN or TURN server from configuration (never a default)."""

    urls: tuple[str, ...]
    username: str | None = None
    credential: str | None = None


def load_aiortc() -> Any:
    try:
        import aiortc
    except ImportError as exc:  # pragma: no cover - the extra is installed in dev and CI
        raise TransportError("the WebRTC transport needs aiortc: pip install 'prfaas[webrtc]'") from exc
    return aiortc


def rtc_configuration(ice_servers: tuple[IceServer, ...]) -> Any:
    aiortc = load_aiortc()
    servers = [aiortc.RTCIceServer(list(s.urls), s.username, s.credential) for s in ice_servers]
    return aiortc.RTCConfiguration(iceServers=servers)  # always explicit: an empty list means host candidates only


class EventLoopThread:
    """An asyncio loop in a daemon thread; `run` waits for a coroutine from any other thread."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float) -> T:
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout_s)
        except TimeoutError:
            future.cancel()
            raise

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        asyncio.run_coroutine_threadsafe(coro, self.loop)

    def close(self, timeout_s: float = 5.0) -> None:
        """Let closing peer connections finish (2 s at most), cancel what is left, stop."""
        if self.loop.is_closed():
            return

        async def drain() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            if tasks:
                _done, pending = await asyncio.wait(tasks, timeout=2.0)
                for task in pending:
                    task.cancel()
                await asyncio.gather(*pending, return_exceptions=True)

        with contextlib.suppress(TimeoutError, RuntimeError):
            self.run(drain(), timeout_s)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout_s)
        if not self.thread.is_alive():
            self.loop.close()


class DataChannelStream:
    """One data channel as a blocking byte stream with the socket methods the TCP code uses
    (`sendall`, `recv_into`, `settimeout`, `shutdown`, `close`). Thread-safe like a socket:
    one reader, writers serialized by the caller. A reader more than RECV_QUEUE_BYTES behind
    breaks the stream: its reads raise ConnectionResetError and the peer connection closes."""

    def __init__(self, loop: EventLoopThread, pc: Any, channel: Any) -> None:
        self._loop = loop
        self._pc = pc
        self._channel = channel
        self._cond = threading.Condition()
        self._messages: collections.deque[memoryview] = collections.deque()
        self._queued = 0  # bytes in `_messages`
        self._overflowed = False  # broken by a reader past RECV_QUEUE_BYTES behind: its reads fail
        self._eof = False
        self._timeout_s: float | None = None
        self._drained = asyncio.Event()  # only touched in the loop thread
        channel.bufferedAmountLowThreshold = BUFFER_HIGH_BYTES // 2
        channel.on("message", self._on_message)
        channel.on("close", self._on_close)
        channel.on("bufferedamountlow", self._drained.set)
        pc.on("connectionstatechange", lambda: self._on_state(pc))

    # -- loop thread -----------------------------------------------------------------------

    def _on_message(self, message: bytes | str) -> None:
        data = message.encode() if isinstance(message, str) else message
        with self._cond:
            if self._eof:
                return
            self._queued += len(data)
            self._cond.notify_all()
            if self._queued <= RECV_QUEUE_BYTES:
                self._messages.append(memoryview(data))
                return
            # Dropped, not delivered short: the reader gets an error, never a stream with a hole in it
            self._overflowed, self._messages, self._queued = True, collections.deque(), 0
        self.close()  # the sender sees the channel close and resends on another stream

    def _on_close(self) -> None:
        with self._cond:
            self._eof = True
            self._cond.notify_all()
        self._drained.set()

    def _on_state(self, pc: Any) -> None:
        if pc.connectionState in ("failed", "closed"):
            self._on_close()

    async def _send(self, data: bytes) -> None:
        for offset in range(0, len(data), MESSAGE_BYTES):
            while self._channel.bufferedAmount > BUFFER_HIGH_BYTES and not self._eof:
                self._drained.clear()
                queued = self._channel.bufferedAmount
                try:
                    await asyncio.wait_for(self._drained.wait(), STALL_S)
                except TimeoutError:
                    if self._channel.bufferedAmount >= queued:  # nothing left in STALL_S: the peer is gone
                        self._on_close()
                        self._channel.close()
                        raise ConnectionResetError(f"data channel stalled for {STALL_S} s") from None
            if self._eof or self._channel.readyState != "open":
                raise ConnectionResetError("data channel closed")
            self._channel.send(data[offset : offset + MESSAGE_BYTES])

    # -- socket-like, from any thread ------------------------------------------------------

    def sendall(self, data: bytes | bytearray | memoryview) -> None:
        if self._eof:
            raise BrokenPipeError("data channel closed")
        try:
            self._loop.run(self._send(bytes(data)), timeout_s=3600.0)  # bounded by the transfer deadline
        except RuntimeError as exc:  # the loop stopped (close)
            raise ConnectionResetError(str(exc)) from None

    def writable(self) -> bool:
        """Whether `sendall` would queue its bytes without waiting for the peer to drain the channel (a
        closed one: yes, and the send fails at once)."""
        return self._eof or self._channel.bufferedAmount <= BUFFER_HIGH_BYTES

    def recv_into(self, view: memoryview, nbytes: int = 0) -> int:
        want = nbytes or len(view)
        with self._cond:
            if not self._cond.wait_for(lambda: self._messages or self._eof, self._timeout_s):
                raise TimeoutError("timed out waiting for the data channel")
            if self._overflowed:
                raise ConnectionResetError(
                    f"data channel broken: its reader fell over {RECV_QUEUE_BYTES >> 20} MiB behind"
                )
            got = 0
            while self._messages and got < want:
                head = self._messages[0]
                take = min(len(head), want - got)
                view[got : got + take] = head[:take]
                got += take
                self._queued -= take
                if take == len(head):
                    self._messages.popleft()
                else:
                    self._messages[0] = head[take:]
            return got  # 0: closed

    def settimeout(self, timeout_s: float | None) -> None:
        self._timeout_s = timeout_s

    def getsockopt(self, *_args: object) -> bytes:
        raise OSError("a data channel is not a TCP socket")

    def setsockopt(self, *_args: object) -> None:
        raise OSError("a data channel is not a TCP socket")

    def getpeername(self) -> tuple[str, int]:
        return ("webrtc", 0)

    def shutdown(self, _how: int = 0) -> None:
        self.close()

    def close(self) -> None:
        with self._cond:
            if self._eof and self._pc is None:
                return
            self._eof = True
            self._cond.notify_all()
            pc, self._pc = self._pc, None
        if pc is not None and not self._loop.loop.is_closed():
            with contextlib.suppress(RuntimeError):
                self._loop.loop.call_soon_threadsafe(self._drained.set)
                self._loop.spawn(pc.close())


def dial(loop: EventLoopThread, signal: Signaller, ice_servers: tuple[IceServer, ...], timeout_s: float) -> Any:
    """Offer, signal, answer, wait for the data channel to open: a connected stream.
    Failures are OSError (ConnectionError / TimeoutError), as a TCP connect's are."""
    aiortc = load_aiortc()

    async def offer() -> tuple[Any, Any, asyncio.Event, Description]:
        pc = aiortc.RTCPeerConnection(configuration=rtc_configuration(ice_servers))
        channel = pc.createDataChannel("prfaas-kv", ordered=True)
        opened = asyncio.Event()
        channel.on("open", opened.set)
        await pc.setLocalDescription(await pc.createOffer())  # gathers the host candidates
        return pc, channel, opened, {"type": pc.localDescription.type, "sdp": pc.localDescription.sdp}

    pc, channel, opened, local = loop.run(offer(), timeout_s)
    stream = DataChannelStream(loop, pc, channel)
    try:
        try:
            answer = signal(local, timeout_s)
        except (TransportError, ValueError, KeyError) as exc:
            raise ConnectionError(f"WebRTC signalling failed: {exc}") from exc
        if not isinstance(answer, dict) or answer.get("type") != "answer" or not isinstance(answer.get("sdp"), str):
            raise ConnectionError(f"WebRTC signalling gave no answer: {str(answer)[:200]}")

        async def finish() -> None:
            await pc.setRemoteDescription(aiortc.RTCSessionDescription(sdp=answer["sdp"], type="answer"))
            await asyncio.wait_for(opened.wait(), timeout_s)

        try:
            loop.run(finish(), timeout_s + 1)
        except OSError:
            raise
        except Exception as exc:  # aiortc's SDP parser asserts, indexes, and raises its own errors on a bad answer
            raise ConnectionError(f"bad SDP answer: {exc!r}") from None
    except BaseException:
        stream.close()
        raise
    return stream
