"""Key- and value-aware quantization of one KV tensor: the lossy half of the kv8, kv6 and kv4
codecs (transport/codecs.py), measured on SmolLM2 in docs/benchmarks.md ("KV codecs").

A tensor is [num_kv_heads, num_tokens, head_dim], float32, float16 or bfloat16, and is either a
layer's keys or its values (`TensorMeta.part`); the two are quantized differently (KIVI's
finding, and ours: docs/benchmarks.md):

- Keys, per channel: each (head, channel) is centred by its mean over the tokens (kept in
  float32), then quantized to symmetric integer codes in [-qmax, qmax] with one scale per
  (head, token group, channel): amax over the group's tokens / qmax. Keys carry outlier
  channels; a scale per channel keeps them from costing the others their precision.
- Values, per token: each token's head_dim values are first rotated by the orthonormal
  Walsh-Hadamard matrix (when head_dim is a power of two), which spreads a token's few large
  channels over all of them, then quantized with one scale per (head, token). The decoder
  rotates back (the matrix is its own inverse). Attention weighs values by token, so their
  error averages out across tokens; a per-token scale fits them.

Scales are bfloat16 (the encoder quantizes with the rounded scale, so the decoder's is the
same); codes are one byte each (code + qmax), so the lossless stage's entropy coder (zstd)
spends on them what their distribution needs (~7.4 bits per key code at qmax 127). Error
bound: every element is within scale / 2 of its value, the values' after the rotation back
(an orthonormal rotation keeps the error's norm). Stateless, so shared between threads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache

import numpy as np
import torch

from prfaas.transport.errors import CodecError
from prfaas.transport.quant import TORCH_DTYPES, _tensor_bytes, _to_float32

Shape = tuple[int, int, int]  # [num_kv_heads, num_tokens, head_dim]
KEYS, VALUES = 0, 1


@cache
def hadamard(n: int) -> torch.Tensor:
    """The orthonormal n x n Walsh-Hadamard matrix (n a power of two): symmetric, its own inverse."""
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h / math.sqrt(n)


def _rotates(head_dim: int) -> bool:
    return head_dim > 1 and head_dim & (head_dim - 1) == 0


@dataclass(frozen=True)
class KVQuantizer:
    """`k_qmax`, `v_qmax`: the largest code of keys and values (127: 8-bit codes, 63: 7-bit, 7: 4-bit);
    `k_group`: tokens per key scale (0: one scale per channel over all tokens)."""

    name: str
    k_qmax: int
    v_qmax: int
    k_group: int = 0

    def _groups(self, num_tokens: int) -> int:
        return 1 if not self.k_group else max(1, -(-num_tokens // self.k_group))

    def aux_bytes(self, shape: Shape, part: int) -> int:
        """Bytes of side data (means, scales) before the codes."""
        heads, tokens, head_dim = shape
        if part == KEYS:
            return heads * head_dim * 4 + heads * self._groups(tokens) * head_dim * 2
        return heads * tokens * 2

    def quantize(self, data: memoryview, dtype: str, shape: Shape, part: int) -> tuple[bytes, bytes]:
        """(side data, one code byte per element)."""
        if 0 in shape:
            return bytes(self.aux_bytes(shape, part)), b""
        x = _to_float32(data, dtype, shape)
        if not bool(torch.isfinite(x).all()):
            raise CodecError(f"{self.name} cannot encode a tensor holding NaN or infinity; use a lossless codec")
        if part == KEYS:
            return self._keys(x)
        return self._values(x)

    def _keys(self, x: torch.Tensor) -> tuple[bytes, bytes]:
        heads, tokens, head_dim = x.shape
        mean = x.mean(dim=1, keepdim=True)
        y = x - mean
        groups = self._groups(tokens)
        size = tokens if not self.k_group else self.k_group
        padded = torch.nn.functional.pad(y, (0, 0, 0, groups * size - tokens)).view(heads, groups, size, head_dim)
        scale = _scale(padded.abs().amax(dim=2, keepdim=True), self.k_qmax)  # [heads, groups, 1, head_dim]
        codes = _codes(padded / scale, self.k_qmax).view(heads, groups * size, head_dim)[:, :tokens]
        return mean.numpy().tobytes() + _tensor_bytes(scale.to(torch.bfloat16)), _tensor_bytes(codes)

    def _values(self, x: torch.Tensor) -> tuple[bytes, bytes]:
        if _rotates(x.shape[2]):
            x = x @ hadamard(x.shape[2])
        scale = _scale(x.abs().amax(dim=2, keepdim=True), self.v_qmax)  # [heads, tokens, 1]
        return _tensor_bytes(scale.to(torch.bfloat16)), _tensor_bytes(_codes(x / scale, self.v_qmax))

    def dequantize(self, codes: bytearray, aux: memoryview, dtype: str, shape: Shape, part: int) -> bytes:
        heads, tokens, head_dim = shape
        if 0 in shape:
            return b""
        qmax = self.k_qmax if part == KEYS else self.v_qmax
        code = torch.frombuffer(codes, dtype=torch.uint8).view(shape).float().sub_(qmax)
        if part == KEYS:
            mean = torch.from_numpy(np.frombuffer(aux[: heads * head_dim * 4], dtype="<f4").copy())
            groups = self._groups(tokens)
            scale = _read_scales(aux[heads * head_dim * 4 :], (heads, groups, 1, head_dim), self.name)
            size = tokens if not self.k_group else self.k_group
            padded = torch.nn.functional.pad(code, (0, 0, 0, groups * size - tokens))
            y = (padded.view(heads, groups, size, head_dim) * scale).view(heads, groups * size, head_dim)[:, :tokens]
            x = y + mean.view(heads, 1, head_dim)
        else:
            x = code.mul_(_read_scales(aux, (heads, tokens, 1), self.name))
            if _rotates(head_dim):
                x = x @ hadamard(head_dim)
        return _tensor_bytes(x.to(TORCH_DTYPES[dtype]))


def _scale(amax: torch.Tensor, qmax: int) -> torch.Tensor:
    """amax / qmax rounded to bfloat16 (what the decoder reads), 1 where amax is 0."""
    scale = (amax / qmax).to(torch.bfloat16).float()
    return torch.where(scale > 0, scale, 1.0)


def _codes(y: torch.Tensor, qmax: int) -> torch.Tensor:
    """Offset codes: round(y) in [-qmax, qmax], + qmax, as bytes (a bf16-rounded scale may fall short)."""
    return y.round_().clamp_(-qmax, qmax).add_(qmax).to(torch.uint8)


def _read_scales(aux: memoryview, shape: tuple[int, ...], name: str) -> torch.Tensor:
    raw = np.frombuffer(aux, dtype="<u2").astype(np.uint32) << 16  # bfloat16: the top half of a float32
    scale = torch.from_numpy(raw.view(np.float32)).view(shape)
    if not bool((torch.isfinite(scale) & (scale > 0)).all()):
        raise CodecError(f"{name} payload holds a scale that is not a positive finite number")
    return scale


KV_QUANTIZERS = {
    q.name: q
    for q in (
        KVQuantizer("kv8", k_qmax=127, v_qmax=63),  # 8-bit keys, 7-bit rotated values
        KVQuantizer("kv6", k_qmax=63, v_qmax=31),  # 7-bit keys, 6-bit rotated values
        KVQuantizer("kv4", k_qmax=7, v_qmax=7, k_group=64),  # 4-bit keys (a scale per 64 tokens), 4-bit values
    )
}
