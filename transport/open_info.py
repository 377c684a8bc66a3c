"""What an OPEN frame announces about a shipment, parsed and checked before anything is stored
(docs/wire-format.md): the receivers' first look at a peer's JSON, so every field is type-checked and
bounded here."""

from __future__ import annotations

from dataclasses import dataclass, field

from prfaas.transport.api import Shape
from prfaas.transport.codecs import DTYPE_SIZES, CodecId, get_codec
from prfaas.transport.errors import CodecError, FrameError

MAX_TRACEPARENT = 128  # a W3C traceparent is 55 characters
MAX_LAYERS = 1024  # the most layers an OPEN may announce (models have ~30-130): each part costs a buffer


@dataclass(frozen=True)
class OpenInfo:
    """What an OPEN frame announces about a shipment (docs/wire-format.md)."""

    dtype: str
    layer_shapes: tuple[Shape, ...]
    codec: int
    chunk_bytes: int
    traceparent: str = field(default="", compare=False)  # the sender's trace context (W3C); "" without tracing

    @property
    def raw_bytes(self) -> int:
        return sum(2 * h * t * d * DTYPE_SIZES[self.dtype] for h, t, d in self.layer_shapes)

    def to_json(self, ticket: str) -> dict[str, object]:
        value: dict[str, object] = {
            "ticket": ticket, "num_layers": len(self.layer_shapes), "dtype": self.dtype,
            "layer_shapes": [list(s) for s in self.layer_shapes], "codec": self.codec, "chunk_bytes": self.chunk_bytes,
        }  # fmt: skip
        if self.traceparent:
            value["traceparent"] = self.traceparent
        return value

    @staticmethod
    def from_json(value: object) -> tuple[OpenInfo, str]:
        """Parse and validate an OPEN payload: (info, ticket)."""
        if not isinstance(value, dict):
            raise FrameError("OPEN payload is not a JSON object")
        try:
            ticket, dtype, codec, chunk_bytes = value["ticket"], value["dtype"], value["codec"], value["chunk_bytes"]
            shapes = tuple(tuple(_whole(d) for d in s) for s in value["layer_shapes"])
            num_layers = value["num_layers"]
        except (KeyError, TypeError, ValueError) as exc:
            raise FrameError(f"OPEN payload is missing or mistyping a field: {exc}") from None
        if not isinstance(ticket, str) or not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
            raise FrameError(f"OPEN payload has a bad ticket or dtype {dtype!r}")
        if num_layers != len(shapes) or not shapes or any(len(s) != 3 or min(s) < 0 for s in shapes):
            raise FrameError("OPEN layer_shapes must be num_layers lists of [heads, tokens, head_dim]")
        if len(shapes) > MAX_LAYERS:
            raise FrameError(f"OPEN announces {len(shapes)} layers, more than {MAX_LAYERS}")
        if not isinstance(chunk_bytes, int) or not 4096 <= chunk_bytes <= 16 << 20:
            raise FrameError(f"OPEN chunk_bytes {chunk_bytes!r} outside [4 KiB, 16 MiB]")
        try:
            get_codec(CodecId(codec))
        except (ValueError, CodecError):
            raise FrameError(f"OPEN names unknown codec id {codec!r}") from None
        trace = value.get("traceparent", "")  # optional; a peer before it sends none, one after it is ignored
        if not isinstance(trace, str) or len(trace) > MAX_TRACEPARENT:
            raise FrameError(f"OPEN traceparent must be a string of at most {MAX_TRACEPARENT} characters")
        return OpenInfo(dtype, shapes, int(codec), chunk_bytes, trace), ticket  # type: ignore[arg-type]


def _whole(value: object) -> int:
    """A JSON integer (not a float, a bool or a string): TypeError otherwise."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{value!r} is not an integer")
    return value
