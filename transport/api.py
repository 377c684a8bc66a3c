"""The transport's small API (CONVENTIONS.md item 8), shared by every implementation.

Sender side:

    shipment = Shipment(spec)             # what to ship, to whom, with which codec
    transfer = channel.submit(shipment)   # starts at once; returns a `Transfer`
    shipment.add_layer(i, k, v)           # as each layer's KV is computed (any order)
    transfer.wait(timeout_s)              # -> TransferStatus

Lifetime rules: a `wait` timeout does not cancel the transfer; it goes on until it
completes, fails, is canceled or reaches `spec.timeout_s`. Layer buffers handed to
`add_layer` must stay unmodified until the transfer is terminal (the transport may read
them again to resend). `cancel()` is idempotent; `close()` on a channel cancels what is
still running on it.

Receiver side: `receiver.expect(job_id, attempt, timeout_s) -> Inbound` registers a
shipment the receiver holds room for; `Inbound.layer(i, timeout_s)` returns layer `i`'s
decoded K and V as soon as both arrived (compute overlaps transfer), `Inbound.wait`
waits for all of them.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Protocol

from prfaas.transport.codecs import DTYPE_SIZES, get_codec
from prfaas.transport.errors import TransferCanceled, TransferTimeout, TransportError

DEFAULT_CHUNK_BYTES = 1 << 20

Shape = tuple[int, int, int]  # [num_kv_heads, num_tokens, head_dim]
Buffer = bytes | bytearray | memoryview


class TransferStatus(Enum):
    PENDING = "pending"
    IN_FLIGHT = "in_flight"
    COMPLETED = "completed"
    FAILED = "failed"
    TIMEOUT = "timeout"
    CANCELED = "canceled"

    @property
    def terminal(self) -> bool:
        return self in (
            TransferStatus.COMPLETED,
            TransferStatus.FAILED,
            TransferStatus.TIMEOUT,
            TransferStatus.CANCELED,
        )


@dataclass(frozen=True)
class ShipmentSpec:
    """One job attempt's KV shipment.

    layer_shapes: one [num_kv_heads, num_tokens, head_dim] per layer (K and V alike).
    timeout_s: deadline of the whole transfer from `submit`, derived from the job's SLO.
    traceparent: the sender's trace context (W3C), carried in OPEN to the receiver; "" for none.
    key_weights: the model's query energy, [num_layers][num_kv_heads, head_dim]
    (prfaas.engine.calibration), which the kv codecs shape key scales by; None: by range alone.
    """

    job_id: str
    attempt: int
    ticket: str
    dtype: str
    layer_shapes: tuple[Shape, ...]
    codec: str = "lossless"
    timeout_s: float = 30.0
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    traceparent: str = ""
    key_weights: Any = field(default=None, compare=False, repr=False)  # indexable by layer

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_SIZES:
            raise ValueError(f"dtype must be one of {sorted(DTYPE_SIZES)}, got {self.dtype!r}")
        if not self.layer_shapes:
            raise ValueError("a shipment needs at least one layer")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if not 4096 <= self.chunk_bytes <= 16 << 20:
            raise ValueError(f"chunk_bytes must be in [4 KiB, 16 MiB], got {self.chunk_bytes}")
        get_codec(self.codec)  # unknown codec -> CodecError now, not on the hot path
        if self.key_weights is not None:
            if len(self.key_weights) != len(self.layer_shapes):
                raise ValueError(f"key_weights has {len(self.key_weights)} layers, the shipment has {self.num_layers}")
            for index, (heads, _, head_dim) in enumerate(self.layer_shapes):
                if tuple(getattr(self.key_weights[index], "shape", ())) != (heads, head_dim):
                    raise ValueError(f"key_weights[{index}] must have shape ({heads}, {head_dim})")

    def layer_key_weights(self, layer: int) -> Any:
        """The query energy of `layer`'s keys ([num_kv_heads, head_dim]), or None."""
        return None if self.key_weights is None else self.key_weights[layer]

    @property
    def num_layers(self) -> int:
        return len(self.layer_shapes)

    def part_bytes(self, layer: int) -> int:
        heads, tokens, head_dim = self.layer_shapes[layer]
        return heads * tokens * head_dim * DTYPE_SIZES[self.dtype]

    @property
    def raw_bytes(self) -> int:
        return sum(2 * self.part_bytes(i) for i in range(self.num_layers))


LayerListener = Callable[[int, Buffer, Buffer], None]


class Shipment:
    """The producer's handle: layers go in as they are computed.

    Thread-safe. Layers added before `submit` are buffered and sent once submitted.
    """

    def __init__(self, spec: ShipmentSpec) -> None:
        self.spec = spec
        self._lock = threading.Lock()
        self._layers: dict[int, tuple[Buffer, Buffer]] = {}
        self._listener: LayerListener | None = None

    def add_layer(self, index: int, k: Buffer, v: Buffer) -> None:
        """Hand over layer `index`'s K and V. The raw codec sends views of these buffers
        (no copy), so they must not change until the transfer has ended."""
        if not 0 <= index < self.spec.num_layers:
            raise ValueError(f"layer {index} out of range for a {self.spec.num_layers}-layer shipment")
        expected = self.spec.part_bytes(index)
        if len(memoryview(k).cast("B")) != expected or len(memoryview(v).cast("B")) != expected:
            raise ValueError(f"layer {index} K/V must be {expected} bytes each (shape x dtype)")
        with self._lock:
            if index in self._layers:
                raise ValueError(f"layer {index} was already added")
            self._layers[index] = (k, v)
            listener = self._listener
        if listener is not None:
            listener(index, k, v)

    def layer(self, index: int) -> tuple[Buffer, Buffer]:
        with self._lock:
            return self._layers[index]

    def bind(self, listener: LayerListener) -> None:
        """Called once by a channel's `submit`: replays buffered layers, then forwards new ones."""
        with self._lock:
            if self._listener is not None:
                raise ValueError("shipment already submitted")
            self._listener = listener
            pending = sorted(self._layers.items())
        for index, (k, v) in pending:
            listener(index, k, v)


@dataclass
class TransferStats:
    raw_bytes: int = 0  # KV bytes before encoding, acknowledged by the receiver
    wire_bytes: int = 0  # encoded payload bytes sent, resends included
    resent_chunks: int = 0
    resent_bytes: int = 0  # of `wire_bytes`: chunks sent again (their stream broke, or a NACK)
    started_s: float = field(default_factory=time.monotonic)
    finished_s: float | None = None

    @property
    def seconds(self) -> float:
        return (self.finished_s or time.monotonic()) - self.started_s


class StatusCell:
    """A status that moves forward once to a terminal value, with waiters and a deadline."""

    def __init__(self, timeout_s: float) -> None:
        self.deadline = time.monotonic() + timeout_s
        self._cond = threading.Condition()
        self._status = TransferStatus.PENDING
        self.error: TransportError | None = None
        self._on_terminal: list[Callable[[TransferStatus], None]] = []

    def status(self) -> TransferStatus:
        with self._cond:
            return self._status

    def start(self) -> None:
        with self._cond:
            if self._status is TransferStatus.PENDING:
                self._status = TransferStatus.IN_FLIGHT

    def finish(self, status: TransferStatus, error: TransportError | None = None) -> bool:
        """Move to terminal `status`; False if already terminal (first outcome wins)."""
        with self._cond:
            if self._status.terminal:
                return False
            self._status, self.error = status, error
            callbacks = list(self._on_terminal)
            self._cond.notify_all()
        for callback in callbacks:
            callback(status)
        return True

    def on_terminal(self, callback: Callable[[TransferStatus], None]) -> None:
        self._on_terminal.append(callback)

    def expire_if_due(self, now: float | None = None) -> bool:
        if (time.monotonic() if now is None else now) >= self.deadline:
            return self.finish(
                TransferStatus.TIMEOUT, TransferTimeout("deadline reached before the transfer completed")
            )
        return False

    def wait(self, timeout_s: float | None) -> TransferStatus:
        """Wait until terminal, `timeout_s` passes, or the deadline (which ends it: TIMEOUT)."""
        end = time.monotonic() + timeout_s if timeout_s is not None else math.inf
        with self._cond:
            while not self._status.terminal and time.monotonic() < min(end, self.deadline):
                self._cond.wait(min(end, self.deadline) - time.monotonic())
        self.expire_if_due()
        return self.status()

    def cancel(self, reason: str) -> bool:
        return self.finish(TransferStatus.CANCELED, TransferCanceled(reason))


class Transfer(Protocol):
    stats: TransferStats

    def status(self) -> TransferStatus: ...

    def wait(self, timeout_s: float | None = None) -> TransferStatus: ...

    def cancel(self) -> None: ...

    @property
    def error(self) -> TransportError | None: ...


class Channel(Protocol):
    def submit(self, shipment: Shipment) -> Transfer: ...

    def close(self) -> None: ...
