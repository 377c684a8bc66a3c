"""Key- and value-aware quantization of one KV tensor: the lossy half of the kv8, kv6, kv4, kvw6 and
kvw4 codecs (transport/codecs.py), measured on SmolLM2 in docs/benchmarks.md ("KV codecs").

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

Query-weighted key scales (encoder only; the payload and its decoder are the same): given the
model's query energy per key channel (`weights`, [num_kv_heads, head_dim]: E[q_c^2] of the queries
that read this layer's keys, from `prfaas.engine.calibration`), a key channel's step is set by how
much its error moves attention logits (q . dk), not by its own range: step_c = the head's geometric
mean of amax / k_level, times (w_c / geometric mean of w) ^ -1/2, never finer than amax_c / k_qmax (so
codes stay in range). Channels the queries barely read get coarse steps; the ones they weigh get
fine steps, past k_level's. On SmolLM2 this cuts the KL of 4-bit KV by 45% and of 6-bit KV by 37% at
the same bytes (docs/benchmarks.md, "Query-weighted key scales"): kvw6 and kvw4 use it; kv8, kv6 and
kv4 ignore the weights (`weighted`). Without weights (a prefill region whose model is not calibrated)
kvw6 and kvw4 quantize keys by range at `plain_level` (kv6's and kv4's keys: the same steps, codes
offset by 127 instead of 63 or 7), so they are never worse than the codec they replace.

Scales are bfloat16 (the encoder quantizes with the rounded scale, so the decoder's is the
same); codes are one byte each (code + qmax), so the lossless stage's entropy coder (zstd)
spends on them what their distribution needs (~7.4 bits per key code at qmax 127). Error
bound: every element is within scale / 2 of its value, the values' after the rotation back
(an orthonormal rotation keeps the error's norm); decoding clamps to the dtype's finite range, so a value near its
largest never comes back infinite. Stateless, so shared between threads.
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
_FLOAT32_MAX = torch.finfo(torch.float32).max
_BFLOAT16_MAX = torch.finfo(torch.bfloat16).max
MAX_HEAD_DIM = 1024  # the values' rotation is a head_dim x head_dim matrix: a peer's shape must not size it at will


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
    `k_group`: tokens per key scale (0: one scale per channel over all tokens); `k_level`: the code
    that a channel's amax maps to (0: k_qmax), and with query weights the head's geometric mean of
    it; a `k_level` below `k_qmax` leaves the weighted channels room for finer steps; `plain_level`:
    the code a channel's amax maps to when no weights are given (0: the level)."""

    name: str
    k_qmax: int
    v_qmax: int
    k_group: int = 0
    k_level: int = 0
    weighted: bool = True  # shapes key scales by query weights when given (False: ignores them)
    plain_level: int = 0

    def __post_init__(self) -> None:
        if not (0 < self.level <= self.k_qmax and 0 < self.unweighted_level <= self.k_qmax and self.v_qmax > 0):
            raise ValueError(f"{self.name}: key levels must lie in 1..k_qmax ({self.k_qmax}), v_qmax above 0")
        if not 0 < max(self.k_qmax, self.v_qmax) * 2 < 256:
            raise ValueError(f"{self.name}: codes are one byte: qmax at most 127")

    @property
    def level(self) -> int:
        return self.k_level or self.k_qmax

    @property
    def unweighted_level(self) -> int:
        return self.plain_level or self.level

    def _groups(self, num_tokens: int) -> int:
        return 1 if not self.k_group else max(1, -(-num_tokens // self.k_group))

    def aux_bytes(self, shape: Shape, part: int) -> int:
        """Bytes of side data (means, scales) before the codes."""
        heads, tokens, head_dim = shape
        if part == KEYS:
            return heads * head_dim * 4 + heads * self._groups(tokens) * head_dim * 2
        return heads * tokens * 2

    def quantize(
        self, data: memoryview, dtype: str, shape: Shape, part: int, weights: np.ndarray | None = None
    ) -> tuple[bytes, bytes]:
        """(side data, one code byte per element). `weights`: the keys' query energy per
        [head, channel] (ignored for values), or None for scales by range alone."""
        _check_head_dim(shape, self.name)
        if 0 in shape:
            return bytes(self.aux_bytes(shape, part)), b""
        checked = None
        if part == KEYS and weights is not None and self.weighted:
            checked = _checked_weights(weights, shape, self.name)
        x = _to_float32(data, dtype, shape)  # fresh: quantized in place
        try:
            return self._keys(x, checked) if part == KEYS else self._values(x)
        except _NotFinite:
            # Finite values near float32's range (bfloat16, float32) can overflow it once centred (a key channel's
            # sum or spread) or rotated; these are quantized again in float64. NaN and infinity stay refused.
            x = _to_float32(data, dtype, shape).double()
            if not bool(torch.isfinite(x).all()):
                raise
            return self._keys(x, checked) if part == KEYS else self._values(x)

    def _keys(self, x: torch.Tensor, weights: torch.Tensor | None) -> tuple[bytes, bytes]:
        heads, tokens, head_dim = x.shape
        mean = x.mean(dim=1, keepdim=True)
        y = x.sub_(mean)
        groups = self._groups(tokens)
        size = tokens if not self.k_group else self.k_group
        pad = groups * size - tokens
        padded = torch.nn.functional.pad(y, (0, 0, 0, pad)) if pad else y
        grouped = padded.view(heads, groups, size, head_dim)
        amax = _amax(grouped, 2, self.name)  # [heads, groups, 1, head_dim]
        if weights is None:
            scale = _scale(amax, self.unweighted_level)
        else:
            scale = _weighted_scale(amax, weights.view(heads, 1, 1, head_dim), self.level, self.k_qmax)
        codes = _codes(grouped.div_(scale), self.k_qmax).view(heads, groups * size, head_dim)[:, :tokens]
        return mean.float().numpy().tobytes() + _tensor_bytes(scale.to(torch.bfloat16)), _tensor_bytes(codes)

    def _values(self, x: torch.Tensor) -> tuple[bytes, bytes]:
        if _rotates(x.shape[2]):
            x = x @ hadamard(x.shape[2]).to(x.dtype)
        scale = _scale(_amax(x, 2, self.name), self.v_qmax)  # [heads, tokens, 1]
        return _tensor_bytes(scale.to(torch.bfloat16)), _tensor_bytes(_codes(x.div_(scale), self.v_qmax))

    def dequantize(self, codes: bytearray, aux: memoryview, dtype: str, shape: Shape, part: int) -> bytes:
        heads, tokens, head_dim = shape
        _check_head_dim(shape, self.name)
        if 0 in shape:
            return b""
        qmax = self.k_qmax if part == KEYS else self.v_qmax
        if part == KEYS:
            mean = torch.from_numpy(np.frombuffer(aux[: heads * head_dim * 4], dtype="<f4").copy())
            if not bool(torch.isfinite(mean).all()):
                raise CodecError(f"{self.name} payload holds a key mean that is not a finite number")
            groups = self._groups(tokens)
            scale = _read_scales(aux[heads * head_dim * 4 :], (heads, groups, 1, head_dim), self.name)
            reach = (255 - qmax) * float(scale.max()) + float(mean.abs().max())
        else:
            scale = _read_scales(aux, (heads, tokens, 1), self.name)
            reach = (255 - qmax) * float(scale.max()) * (math.sqrt(head_dim) if _rotates(head_dim) else 1.0)
        # `reach` bounds |decoded| (a code is at most 255 - qmax). Near the dtype's largest finite value (a bfloat16
        # scale may round up; the mean or rotation adds on) decoding clamps to it, in float64 where float32 could
        # overflow on the way.
        limit = torch.finfo(TORCH_DTYPES[dtype]).max
        wide = reach > _FLOAT32_MAX / 2
        code = torch.frombuffer(codes, dtype=torch.uint8).view(shape)
        code = (code.double() if wide else code.float()).sub_(qmax)
        if part == KEYS:
            size = tokens if not self.k_group else self.k_group
            pad = groups * size - tokens
            padded = torch.nn.functional.pad(code, (0, 0, 0, pad)) if pad else code
            y = padded.view(heads, groups, size, head_dim).mul_(scale).view(heads, groups * size, head_dim)[:, :tokens]
            x = y.add_(mean.view(heads, 1, head_dim))
        else:
            x = code.mul_(scale)
            if _rotates(head_dim):
                x = x @ hadamard(head_dim).to(x.dtype)
        if reach > limit * 0.999:  # the margin covers float32's rounding on the way
            x = x.clamp_(-limit, limit)
        return _tensor_bytes(x.to(TORCH_DTYPES[dtype]))


def _check_head_dim(shape: Shape, name: str) -> None:
    if shape[2] > MAX_HEAD_DIM:
        raise CodecError(f"{name} carries head_dim up to {MAX_HEAD_DIM}, not {shape[2]}; use a lossless codec")


class _NotFinite(CodecError):
    """A NaN or infinity in the centred or rotated tensor: from the input, or from float32 overflowing."""


def _amax(x: torch.Tensor, dim: int, name: str) -> torch.Tensor:
    """max |x| over `dim` (kept, size 1), without an |x| temporary; _NotFinite if any is not finite. NaN and
    infinity anywhere in the tensor reach it (a NaN through max, an infinity through the key mean: inf - inf)."""
    amax = torch.maximum(x.amax(dim=dim, keepdim=True), x.amin(dim=dim, keepdim=True).neg_())
    if not bool(torch.isfinite(amax).all()):
        raise _NotFinite(f"{name} cannot encode a tensor holding NaN or infinity; use a lossless codec")
    return amax


def _scale(amax: torch.Tensor, qmax: int) -> torch.Tensor:
    """amax / qmax rounded to bfloat16 (what the decoder reads), 1 where amax is 0. CodecError when a step
    is past bfloat16's range (rotated values near float32's largest: no decoder would take the payload)."""
    scale = (amax / qmax).to(torch.bfloat16).float()
    if not bool(torch.isfinite(scale).all()):
        raise CodecError("a quantization step is past bfloat16's range; use a lossless codec")
    return torch.where(scale > 0, scale, 1.0)


def _weighted_scale(amax: torch.Tensor, weights: torch.Tensor, level: int, qmax: int) -> torch.Tensor:
    """Steps [heads, groups, 1, head_dim] ∝ weights^-1/2 around the geometric mean of amax / level over each
    (head, group)'s non-zero channels, none finer than amax / qmax; bfloat16-rounded, 1 where amax is 0."""
    nonzero = amax > 0
    log_amax = amax.clamp_min(torch.finfo(torch.float32).tiny).log()
    count = nonzero.sum(dim=3, keepdim=True).clamp_min(1)
    log_level = (log_amax * nonzero).sum(dim=3, keepdim=True) / count - math.log(level)
    log_w = weights.log()
    shape = -0.5 * (log_w - log_w.mean(dim=3, keepdim=True))
    step = torch.maximum((log_level + shape).exp(), amax / qmax)
    step = step.clamp_max(_BFLOAT16_MAX).to(torch.bfloat16).float()
    return torch.where(nonzero & (step > 0) & torch.isfinite(step), step, 1.0)


def _checked_weights(weights: np.ndarray, shape: Shape, name: str) -> torch.Tensor:
    """`weights` as a float32 [heads, head_dim] tensor floored at 1e-6 of its max; CodecError unless finite, >= 0,
    not all zero and of that shape."""
    w = torch.as_tensor(np.asarray(weights, dtype=np.float32))
    if tuple(w.shape) != (shape[0], shape[2]):
        raise CodecError(f"{name}: key weights of shape {tuple(w.shape)} for keys of shape {shape}")
    if not bool(torch.isfinite(w).all()) or bool((w < 0).any()) or not bool((w > 0).any()):
        raise CodecError(f"{name}: key weights must be finite, non-negative and not all zero")
    return w.clamp_min(float(w.max()) * 1e-6)


def _codes(y: torch.Tensor, qmax: int) -> torch.Tensor:
    """Offset codes: round(y) in [-qmax, qmax], + qmax, as bytes (a bf16-rounded scale may fall short), in place.
    Through int8 (float -> int8 is ~5x faster than float -> uint8 here), then + qmax modulo 256: exact, as
    code + qmax lies in [0, 254]."""
    return y.round_().clamp_(-qmax, qmax).to(torch.int8).view(torch.uint8).add_(qmax)


def _read_scales(aux: memoryview, shape: tuple[int, ...], name: str) -> torch.Tensor:
    raw = np.frombuffer(aux, dtype="<u2").astype(np.uint32) << 16  # bfloat16: the top half of a float32
    scale = torch.from_numpy(raw.view(np.float32)).view(shape)
    if not bool((torch.isfinite(scale) & (scale > 0)).all()):
        raise CodecError(f"{name} payload holds a scale that is not a positive finite number")
    return scale


KV_QUANTIZERS = {
    q.name: q
    for q in (
        # kv8, kv6 and kv4 ignore query weights: on kv8 they only move along its curve (2.23x and 9.1e-5 KL
        # against 2.19x and 8.6e-5, docs/benchmarks.md), and kv6's and kv4's code ranges leave weighted
        # channels no finer steps. kvw6 and kvw4 are the weighted points that win at 6 and 4 bits.
        KVQuantizer("kv8", k_qmax=127, v_qmax=63, weighted=False),  # 8-bit keys, 7-bit rotated values
        KVQuantizer("kv6", k_qmax=63, v_qmax=31, weighted=False),  # 7-bit keys, 6-bit rotated values
        KVQuantizer("kv4", k_qmax=7, v_qmax=7, k_group=64, weighted=False),  # 4-bit keys (a scale per 64 tokens)
        # Query-weighted keys around level 45 (without weights: kv6's keys), kv6's values.
        KVQuantizer("kvw6", k_qmax=127, v_qmax=31, k_level=45, plain_level=63),
        # Query-weighted keys around level 5, a scale per 64 tokens (without weights: kv4's keys), kv4's values.
        KVQuantizer("kvw4", k_qmax=127, v_qmax=7, k_group=64, k_level=5, plain_level=7),
    )
}
