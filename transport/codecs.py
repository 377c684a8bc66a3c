"""KV codecs: how one K or V tensor of one layer becomes a frame payload, and back.

A tensor is [num_kv_heads, num_tokens, head_dim] in C order, as raw little-endian bytes.
Ratios measured on SmolLM2-135M KV, bf16 / fp32 (docs/benchmarks.md, "KV codecs"):

    id  name      lossless  what                                               ratio
    0   raw       yes       the bytes as they are                              1
    1   lossless  yes       blosc2 chunk: byte shuffle + zstd level 1          1.47 / 1.20
    2   fp8       no        e4m3 codes (float32 scale per head), then 1        2.42 / 4.85
    3   int8      no        int8 codes (float32 scale per channel), then 1     2.19 / 4.39
    4-8 kv8, kv6, kv4, kvw6, kvw4: keys per channel, values rotated per token (transport/kvquant.py,
        docs/wire-format.md); 2.25, 2.63, 4.22, 2.67, 4.17 on bf16

LOSSLESS is the measured winner (bench/codec_ratio.py). Byte planes + zstd-1 compress 1%
more but decode slower; zipnn 0.5.4 compresses 1% more and faster on bf16, but holds
the GIL, rewrites the buffer it compresses and aborted the process on a corrupt payload.

Payload of every codec but RAW (whose payload is the tensor's bytes); integers little-endian:

    offset  size  field
    0       4     magic b"PFKC"
    4       1     version (1); a reader refuses any other
    5       1     codec id (`CodecId`)
    6       1     dtype: 0 float32, 1 float16, 2 bfloat16
    7       1     flags (0; a reader refuses others)
    8       8     decoded size in bytes
    16      8     xxh3-64 of every byte after the header
    24      4*n   float32 scales: n = num_kv_heads (fp8), num_kv_heads * head_dim (int8), 0
    24+4n   rest  one blosc2 chunk of the tensor (lossless) or of its codes; empty if 0 bytes

Contracts:
- `decode(encode(data, meta), meta)` is `meta.nbytes` bytes of `meta.dtype`: `data` bit for
  bit (NaNs included) for lossless codecs, dequantized values for lossy ones (error bounds in
  prfaas.transport.quant). Lossy codecs refuse NaN and infinity.
- `encode` raises `CodecError` when `data` is not `meta.nbytes` long. `decode` raises it for a
  truncated or altered payload, or one of another codec, dtype or size; never another
  exception, never bytes of another size. The checksum repeats the frames' on purpose: it
  also catches chunks that each arrived intact but were put together wrongly.
- Codecs are stateless and thread-safe; blosc2 runs one thread per call with the GIL
  released, so concurrent senders compress in parallel.
"""

from __future__ import annotations

import functools
import importlib
import math
import struct
from dataclasses import dataclass, field
from enum import IntEnum
from typing import TYPE_CHECKING, Any, Protocol

import xxhash

from prfaas.transport.errors import CodecError

if TYPE_CHECKING:
    from prfaas.transport.kvquant import KVQuantizer
    from prfaas.transport.quant import Quantizer


class CodecId(IntEnum):
    """Codec ids on the wire; never renumber."""

    RAW = 0
    LOSSLESS = 1
    FP8 = 2
    INT8 = 3
    KV8 = 4
    KV6 = 5
    KV4 = 6
    KVW6 = 7
    KVW4 = 8


# name -> (dtype code on the wire, bytes per element)
_DTYPES: dict[str, tuple[int, int]] = {"float32": (0, 4), "float16": (1, 2), "bfloat16": (2, 2)}
DTYPE_SIZES: dict[str, int] = {name: size for name, (_code, size) in _DTYPES.items()}


@dataclass(frozen=True)
class TensorMeta:
    """What a decoder must know besides the payload: the tensor's dtype and shape, and which part
    of a layer it is (keys and values are quantized differently: the frame header's `part`).

    dtype: "float32" | "float16" | "bfloat16".
    shape: [num_kv_heads, num_tokens, head_dim]; RAW and LOSSLESS accept any shape.
    part: 0 = K, 1 = V.
    key_weights: for the encoder only, and only of keys: the model's query energy per
    [num_kv_heads, head_dim] channel of this layer (prfaas.engine.calibration), which the kv codecs
    shape their key scales by (those that opt in: kvquant.KVQuantizer.weighted); None: scales by range
    alone. The payload decodes without it.
    """

    dtype: str
    shape: tuple[int, ...]
    part: int = 0
    key_weights: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise CodecError(f"unsupported dtype {self.dtype!r}; supported: {', '.join(_DTYPES)}")
        if not all(isinstance(dim, int) and dim >= 0 for dim in self.shape):
            raise CodecError(f"shape must be non-negative ints, got {self.shape!r}")
        if self.part not in (0, 1):
            raise CodecError(f"part must be 0 (K) or 1 (V), got {self.part!r}")

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _DTYPES[self.dtype][1]


class Codec(Protocol):
    codec_id: CodecId
    name: str
    lossless: bool

    def encode(self, data: bytes | memoryview, meta: TensorMeta) -> bytes: ...

    def decode(self, payload: bytes | memoryview, meta: TensorMeta) -> bytes: ...


MAGIC = b"PFKC"
VERSION = 1
_HEADER = struct.Struct("<4sBBBBQQ")
# blosc2 holds at most 2 GiB - 1 - 32 (BLOSC2_MAX_BUFFERSIZE) in one chunk.
_MAX_CHUNK_BYTES = 2**31 - 1 - 32


def _bytes_view(name: str, data: bytes | bytearray | memoryview) -> memoryview:
    try:
        return memoryview(data).cast("B")
    except TypeError as exc:
        raise CodecError(f"{name}: data must be a C-contiguous bytes-like object: {exc}") from exc


def checked_view(name: str, data: bytes | bytearray | memoryview, meta: TensorMeta) -> memoryview:
    """`data` as a flat byte view, checked to hold exactly `meta`'s tensor (CodecError if not)."""
    view = _bytes_view(name, data)
    if view.nbytes != meta.nbytes:
        raise CodecError(
            f"{name}: got {view.nbytes} bytes, a {meta.dtype} tensor of shape {meta.shape} has {meta.nbytes}"
        )
    return view


def _shape3(name: str, meta: TensorMeta) -> tuple[int, int, int]:
    if len(meta.shape) != 3:
        raise CodecError(f"{name} needs a [num_kv_heads, num_tokens, head_dim] shape, got {meta.shape}")
    return meta.shape[0], meta.shape[1], meta.shape[2]


@functools.cache
def _blosc2() -> Any:
    # Lazy (0.5 s to import); through importlib because blosc2 ships no type information.
    blosc2 = importlib.import_module("blosc2")
    # Off by default, so concurrent senders would serialize on the GIL; safe here because
    # compress2/decompress2 create a context per call.
    blosc2.set_releasegil(True)
    return blosc2


@functools.cache
def _quant() -> Any:
    from prfaas.transport import quant  # lazy: brings in torch

    return quant


def _compress(data: memoryview | bytes, typesize: int) -> bytes:
    """The lossless stage: one blosc2 chunk (shuffle by `typesize`, zstd level 1)."""
    if len(data) == 0:
        return b""
    if len(data) > _MAX_CHUNK_BYTES:
        raise CodecError(f"{len(data)} bytes are over the {_MAX_CHUNK_BYTES} of one blosc2 chunk; split by tokens")
    blosc2 = _blosc2()
    chunk = blosc2.compress2(
        data, codec=blosc2.Codec.ZSTD, clevel=1, filters=[blosc2.Filter.SHUFFLE], typesize=typesize, nthreads=1
    )
    return bytes(chunk)


def _chunk_api(body: memoryview, nbytes: int) -> Any:
    """blosc2, after checking that `body` is one chunk decoding to `nbytes` (> 0) bytes."""
    blosc2 = _blosc2()
    try:
        decoded_size, chunk_size, _ = blosc2.get_cbuffer_sizes(body)
    except Exception as exc:  # the C extension raises ValueError, RuntimeError, SystemError
        raise CodecError(f"payload body is not a blosc2 chunk: {exc}") from exc
    if decoded_size != nbytes or chunk_size != len(body):
        raise CodecError(
            f"blosc2 chunk of {len(body)} bytes claims {chunk_size} bytes decoding to {decoded_size}, expected {nbytes}"
        )
    return blosc2


def _decompress(body: memoryview, nbytes: int) -> bytes:
    """`_compress`'s input back, checked to be `nbytes` long."""
    if nbytes == 0:
        _check_empty(body)
        return b""
    blosc2 = _chunk_api(body, nbytes)
    try:
        decoded = blosc2.decompress2(body, nthreads=1)
    except Exception as exc:
        raise CodecError(f"blosc2 chunk does not decompress: {exc}") from exc
    if not isinstance(decoded, bytes) or len(decoded) != nbytes:
        raise CodecError(f"blosc2 chunk decompressed to the wrong size, expected {nbytes} bytes")
    return decoded


def _decompress_into(body: memoryview, out: bytearray) -> None:
    """Like `_decompress`, into `out` (writable, so torch can wrap it)."""
    if not out:
        _check_empty(body)
        return
    blosc2 = _chunk_api(body, len(out))
    try:
        blosc2.decompress2(body, dst=out, nthreads=1)
    except Exception as exc:
        raise CodecError(f"blosc2 chunk does not decompress: {exc}") from exc


def _check_empty(body: memoryview) -> None:
    if len(body):
        raise CodecError(f"payload body of {len(body)} bytes for a tensor of zero bytes")


def _pack(codec_id: CodecId, meta: TensorMeta, scales: bytes, body: bytes) -> bytes:
    checksum = xxhash.xxh3_64()
    checksum.update(scales)
    checksum.update(body)
    header = _HEADER.pack(MAGIC, VERSION, codec_id, _DTYPES[meta.dtype][0], 0, meta.nbytes, checksum.intdigest())
    return b"".join((header, scales, body))


def _unpack(
    name: str, codec_id: CodecId, payload: bytes | memoryview, meta: TensorMeta, num_scales: int
) -> tuple[memoryview, memoryview]:
    """(scales, body) of a payload, after checking its header and checksum against `meta`."""
    return _unpack_aux(name, codec_id, payload, meta, 4 * num_scales)


def _unpack_aux(
    name: str, codec_id: CodecId, payload: bytes | memoryview, meta: TensorMeta, aux_bytes: int
) -> tuple[memoryview, memoryview]:
    """(side data of `aux_bytes`, body) of a payload, after checking its header and checksum against `meta`."""
    view = _bytes_view(name, payload)
    if len(view) < _HEADER.size + aux_bytes:
        raise CodecError(f"{name} payload truncated: {len(view)} bytes, at least {_HEADER.size + aux_bytes} needed")
    magic, version, wire_id, dtype_code, flags, nbytes, checksum = _HEADER.unpack_from(view)
    if magic != MAGIC:
        raise CodecError(f"{name} payload starts with {bytes(magic)!r}, not the codec magic {MAGIC!r}")
    if version != VERSION:
        raise CodecError(f"{name} payload has version {version}; this build reads version {VERSION}")
    if wire_id != codec_id:
        raise CodecError(f"payload was encoded by codec id {wire_id}, decoding it as {name} ({int(codec_id)})")
    if dtype_code != _DTYPES[meta.dtype][0] or nbytes != meta.nbytes:
        raise CodecError(f"{name} payload holds {nbytes} bytes of dtype code {dtype_code}, meta expects {meta}")
    if flags != 0:
        raise CodecError(f"{name} payload has unknown flags {flags:#04x}")
    rest = view[_HEADER.size :]
    if xxhash.xxh3_64_intdigest(rest) != checksum:
        raise CodecError(f"{name} payload checksum mismatch: altered or truncated")
    return rest[:aux_bytes], rest[aux_bytes:]


class RawCodec:
    """The tensor's bytes as they are; integrity is the frame's checksum."""

    codec_id = CodecId.RAW
    name = "raw"
    lossless = True

    def encode(self, data: bytes | memoryview, meta: TensorMeta) -> bytes:
        return bytes(checked_view(self.name, data, meta))

    def decode(self, payload: bytes | memoryview, meta: TensorMeta) -> bytes:
        return bytes(checked_view(self.name, payload, meta))


class LosslessCodec:
    """blosc2 byte shuffle + zstd level 1: exact, ~1.47x on bf16 KV, ~1.2x on fp32."""

    codec_id = CodecId.LOSSLESS
    name = "lossless"
    lossless = True

    def encode(self, data: bytes | memoryview, meta: TensorMeta) -> bytes:
        view = checked_view(self.name, data, meta)
        return _pack(self.codec_id, meta, b"", _compress(view, _DTYPES[meta.dtype][1]))

    def decode(self, payload: bytes | memoryview, meta: TensorMeta) -> bytes:
        _, body = _unpack(self.name, self.codec_id, payload, meta, 0)
        return _decompress(body, meta.nbytes)


class QuantizedCodec:
    """Scaled 8-bit codes (prfaas.transport.quant) and their scales, codes through the lossless stage."""

    lossless = False

    def __init__(self, codec_id: CodecId, name: str) -> None:
        self.codec_id = codec_id
        self.name = name

    def _quantizer(self) -> Quantizer:
        quantizer: Quantizer = _quant().QUANTIZERS[self.name]
        return quantizer

    def encode(self, data: bytes | memoryview, meta: TensorMeta) -> bytes:
        view = checked_view(self.name, data, meta)
        scales, codes = self._quantizer().quantize(view, meta.dtype, _shape3(self.name, meta))
        return _pack(self.codec_id, meta, scales, _compress(codes, 1))

    def decode(self, payload: bytes | memoryview, meta: TensorMeta) -> bytes:
        shape = _shape3(self.name, meta)
        quantizer = self._quantizer()
        scales, body = _unpack(self.name, self.codec_id, payload, meta, quantizer.num_scales(shape))
        codes = bytearray(math.prod(shape))
        _decompress_into(body, codes)
        return quantizer.dequantize(codes, scales, meta.dtype, shape)


class KVQuantizedCodec:
    """Keys per channel, values rotated and per token (prfaas.transport.kvquant), codes through the lossless
    stage. The payload's side data is the keys' means and scales, or the values' scales."""

    lossless = False

    def __init__(self, codec_id: CodecId, name: str, quantizer: KVQuantizer | None = None) -> None:
        """`quantizer`: other parameters than the wire codec `name`'s (benchmarks: bench/codec_quality.py)."""
        self.codec_id = codec_id
        self.name = name
        self._given = quantizer

    def _quantizer(self) -> KVQuantizer:
        from prfaas.transport.kvquant import KV_QUANTIZERS

        return self._given or KV_QUANTIZERS[self.name]

    def encode(self, data: bytes | memoryview, meta: TensorMeta) -> bytes:
        view = checked_view(self.name, data, meta)
        weights = meta.key_weights if meta.part == 0 else None
        aux, codes = self._quantizer().quantize(view, meta.dtype, _shape3(self.name, meta), meta.part, weights)
        return _pack(self.codec_id, meta, aux, _compress(codes, 1))

    def decode(self, payload: bytes | memoryview, meta: TensorMeta) -> bytes:
        shape = _shape3(self.name, meta)
        quantizer = self._quantizer()
        aux, body = _unpack_aux(self.name, self.codec_id, payload, meta, quantizer.aux_bytes(shape, meta.part))
        codes = bytearray(math.prod(shape))
        _decompress_into(body, codes)
        return quantizer.dequantize(codes, aux, meta.dtype, shape, meta.part)


_CODECS: tuple[Codec, ...] = (
    RawCodec(),
    LosslessCodec(),
    QuantizedCodec(CodecId.FP8, "fp8"),
    QuantizedCodec(CodecId.INT8, "int8"),
    KVQuantizedCodec(CodecId.KV8, "kv8"),
    KVQuantizedCodec(CodecId.KV6, "kv6"),
    KVQuantizedCodec(CodecId.KV4, "kv4"),
    KVQuantizedCodec(CodecId.KVW6, "kvw6"),
    KVQuantizedCodec(CodecId.KVW4, "kvw4"),
)
_BY_NAME: dict[str, Codec] = {codec.name: codec for codec in _CODECS}
_BY_ID: dict[int, Codec] = {int(codec.codec_id): codec for codec in _CODECS}
CODEC_NAMES: tuple[str, ...] = tuple(_BY_NAME)


def get_codec(name_or_id: str | int | CodecId) -> Codec:
    """The codec of a name ("lossless") or wire id (1, `CodecId.LOSSLESS`)."""
    codec: Codec | None = None
    if isinstance(name_or_id, str):
        codec = _BY_NAME.get(name_or_id)
    elif isinstance(name_or_id, int) and not isinstance(name_or_id, bool):
        codec = _BY_ID.get(int(name_or_id))
    if codec is None:
        known = ", ".join(f"{codec.name} ({int(codec.codec_id)})" for codec in _CODECS)
        raise CodecError(f"unknown codec {name_or_id!r}; known: {known}")
    return codec
