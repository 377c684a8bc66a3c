"""Scaled 8-bit quantization of one KV tensor: the lossy half of the fp8 and int8 codecs.

A tensor is [num_kv_heads, num_tokens, head_dim] in float32, float16 or bfloat16, as raw
little-endian bytes. Quantizing gives one 8-bit code per element and float32 scales:

- fp8: float8 e4m3fn codes, one scale per head (amax over tokens and head_dim / 448), so
  every element keeps e4m3's 3 mantissa bits: relative error <= 2**-4, or an absolute error
  <= scale * 2**-10 below e4m3's smallest normal (2**-6 * scale).
- int8: symmetric int8 codes in [-127, 127], one scale per (head, head_dim channel) (amax
  over tokens / 127), so every element is within scale / 2. Per channel because keys have
  outlier channels that a per-head scale would spread over all the others.

Dequantizing computes code * scale in float32, clamps it to the dtype's finite range (a peer's
scale may be finite yet large) and rounds to the dtype; an fp8 payload holding e4m3fn's NaN
code bytes (0x7F, 0xFF: quantize never makes them) is refused. Torch
does the float8 cast; this module is imported only when a lossy codec is first used.
Quantizers are stateless, so safe to share between threads.
"""

from __future__ import annotations

import numpy as np
import torch

from prfaas.transport.errors import CodecError

Shape = tuple[int, int, int]  # [num_kv_heads, num_tokens, head_dim]

TORCH_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# Integer dtype of each float dtype's width: fp8 decoding gathers output bit patterns.
_BITS_DTYPES: dict[str, torch.dtype] = {"float32": torch.int32, "float16": torch.int16, "bfloat16": torch.int16}
# The e4m3fn value of each of the 256 code bytes (0x7F and 0xFF are NaN; quantize never makes them).
_FP8_VALUES = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()


def _to_float32(data: memoryview, dtype: str, shape: Shape) -> torch.Tensor:
    """A fresh, writable float32 copy of the tensor in `data` (which may be read-only)."""
    if dtype == "bfloat16":  # bfloat16 is the top half of a float32
        wide = np.frombuffer(data, dtype="<u2").astype(np.uint32)
        wide <<= 16
        array = wide.view(np.float32)
    else:
        array = np.frombuffer(data, dtype="<f4" if dtype == "float32" else "<f2").astype(np.float32)
    return torch.from_numpy(array).view(shape)


def _scales(x: torch.Tensor, dims: tuple[int, ...], qmax: float, name: str) -> torch.Tensor:
    """amax / qmax over `dims` (1 where that is 0), float32 with `dims` kept as size 1, rounded down where float32
    rounded it up: qmax * scale never exceeds amax, so near float32's largest value no code decodes past it."""
    amax = torch.maximum(x.amax(dim=dims, keepdim=True), -x.amin(dim=dims, keepdim=True))
    if not bool(torch.isfinite(amax).all()):
        raise CodecError(f"{name} cannot encode a tensor holding NaN or infinity; use a lossless codec")
    scales = amax / qmax
    scales = torch.where(scales.double() * qmax > amax.double(), scales.nextafter(torch.zeros(())), scales)
    return torch.where(scales > 0, scales, 1.0)


def _checked_scales(scales: memoryview, shape: tuple[int, ...], name: str) -> torch.Tensor:
    scale = torch.from_numpy(np.frombuffer(scales, dtype="<f4").copy()).view(shape)
    if not bool((torch.isfinite(scale) & (scale > 0)).all()):
        raise CodecError(f"{name} payload holds a scale that is not a positive finite number")
    return scale


def _tensor_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


class Fp8Quantizer:
    name = "fp8"
    qmax = 448.0  # largest finite e4m3fn

    def num_scales(self, shape: Shape) -> int:
        return shape[0]

    def quantize(self, data: memoryview, dtype: str, shape: Shape) -> tuple[bytes, bytes]:
        """(scales as float32 bytes, one code byte per element)."""
        if 0 in shape:
            return np.ones(shape[0], dtype="<f4").tobytes(), b""
        x = _to_float32(data, dtype, shape)
        scales = _scales(x, (1, 2), self.qmax, self.name)
        codes = x.div_(scales).clamp_(-self.qmax, self.qmax).to(torch.float8_e4m3fn)
        return scales.numpy().tobytes(), _tensor_bytes(codes)

    def dequantize(self, codes: bytearray, scales: memoryview, dtype: str, shape: Shape) -> bytes:
        if 0 in shape:
            return b""
        num_heads = shape[0]
        scale = _checked_scales(scales, (num_heads, 1), self.name)
        code_array = np.frombuffer(codes, dtype=np.uint8).reshape(num_heads, -1)
        # 0x7F and 0xFF are e4m3fn's NaN: quantize never makes them, so a payload holding one was forged.
        if bool(np.any((code_array & 0x7F) == 0x7F)):
            raise CodecError(f"{self.name} payload holds a NaN code byte (0x7F or 0xFF)")
        # Per head, the 256 possible outputs already scaled and rounded to dtype, as bit
        # patterns; decoding is then one gather (torch's float8 -> float32 cast is ~10x slower).
        # Clamped first: a payload's scale may carry 448 * scale past the dtype's largest finite value.
        limit = torch.finfo(TORCH_DTYPES[dtype]).max
        values = (_FP8_VALUES.view(1, 256) * scale).clamp_(-limit, limit)
        table = values.to(TORCH_DTYPES[dtype]).view(_BITS_DTYPES[dtype]).numpy()
        out = np.empty(code_array.shape, dtype=table.dtype)
        for head in range(num_heads):
            np.take(table[head], code_array[head], out=out[head])
        return out.tobytes()


class Int8Quantizer:
    name = "int8"
    qmax = 127.0

    def num_scales(self, shape: Shape) -> int:
        return shape[0] * shape[2]

    def quantize(self, data: memoryview, dtype: str, shape: Shape) -> tuple[bytes, bytes]:
        """(scales as float32 bytes, one code byte per element)."""
        if 0 in shape:
            return np.ones(shape[0] * shape[2], dtype="<f4").tobytes(), b""
        x = _to_float32(data, dtype, shape)
        scales = _scales(x, (1,), self.qmax, self.name)
        codes = x.div_(scales).round_().clamp_(-self.qmax, self.qmax).to(torch.int8)
        return scales.numpy().tobytes(), _tensor_bytes(codes)

    def dequantize(self, codes: bytearray, scales: memoryview, dtype: str, shape: Shape) -> bytes:
        if 0 in shape:
            return b""
        scale = _checked_scales(scales, (shape[0], 1, shape[2]), self.name)
        x = torch.frombuffer(codes, dtype=torch.int8).view(shape).float().mul_(scale)
        limit = torch.finfo(TORCH_DTYPES[dtype]).max
        if 128 * float(scale.max()) > limit:  # a payload's codes may decode past the dtype's largest finite value
            x = x.clamp_(-limit, limit)
        return _tensor_bytes(x.to(TORCH_DTYPES[dtype]))


Quantizer = Fp8Quantizer | Int8Quantizer
QUANTIZERS: dict[str, Quantizer] = {"fp8": Fp8Quantizer(), "int8": Int8Quantizer()}
