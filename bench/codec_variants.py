"""What bench/codec_quality.py measures besides the wire codecs: a control, quantizer ablations, and keys
quantized before their rotary embedding. None of these is a codec on the wire.

- `bf16-round`: float32 KV rounded to bfloat16 and back (the error a bfloat16 prefill brings anyway).
- ablations (`fp8-k-only`, ...): one quantizer on K and one on V, in float32, to find where a codec's
  error comes from.
- `pre:CODEC` (KVQuant's pre-RoPE keys): a kv codec whose keys are first rotated back to before RoPE,
  quantized there, and rotated forward after decoding (values as the codec has them). Before RoPE a key
  channel keeps its sign and offset over the tokens, so the per-channel mean and scale fit it; after RoPE
  the fast-turning channel pairs mix. Query weights (kvw6, kvw4) are averaged over each pair that turns
  more than 3 radians over a prompt (the query energy is measured after RoPE). The prompts' KV starts at
  position 0, as the bench prefills it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from prfaas.transport.codecs import Codec, CodecId, TensorMeta
from prfaas.transport.quant import TORCH_DTYPES


def tensor_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


class Bf16Rounding:
    """A control, not a transport codec: float32 KV rounded to bfloat16 and back, the error a
    bfloat16 prefill would bring anyway. Puts the lossy codecs' figures in proportion."""

    codec_id = CodecId.RAW  # never on the wire
    name = "bf16-round"
    lossless = False

    def encode(self, data: bytes | memoryview, meta: TensorMeta) -> bytes:
        if meta.dtype != "float32":
            raise SystemExit("the bf16-round control needs --dtype float32")
        x = torch.frombuffer(bytearray(data), dtype=torch.float32)
        return tensor_bytes(x.to(torch.bfloat16).float())

    def decode(self, payload: bytes | memoryview, meta: TensorMeta) -> bytes:
        return bytes(payload)


F8 = torch.float8_e4m3fn


def _fp8(x: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """e4m3 roundtrip with one scale per slice over `dims` (amax / 448)."""
    scale = (x.abs().amax(dim=dims, keepdim=True) / 448.0).clamp_min(1e-30)
    return (x / scale).clamp(-448.0, 448.0).to(F8).float() * scale


def _int8(x: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    scale = (x.abs().amax(dim=dims, keepdim=True) / 127.0).clamp_min(1e-30)
    return (x / scale).round().clamp(-127.0, 127.0) * scale


def _companded_fp8(x: torch.Tensor, power: float, dims: tuple[int, ...]) -> torch.Tensor:
    """fp8 of sign(x)|x|^power: finer steps for large values, coarser for small ones."""
    y = _fp8(x.sign() * x.abs().pow(power), dims)
    return y.sign() * y.abs().pow(1.0 / power)


Quantize = Callable[[torch.Tensor], torch.Tensor]
HEAD, CHANNEL = (1, 2), (1,)  # amax over (tokens, head_dim) per head; over tokens per (head, channel)


class Ablation:
    """Not a codec: a quantizer variant applied to K and V separately ([heads, tokens, head_dim],
    float32 math), to find where the lossy codecs' error comes from."""

    codec_id = CodecId.RAW  # never on the wire
    lossless = False

    def __init__(self, name: str, k: Quantize, v: Quantize) -> None:
        self.name, self.k, self.v = name, k, v


def _exact(x: torch.Tensor) -> torch.Tensor:
    return x


ABLATIONS = {
    a.name: a
    for a in (
        Ablation("fp8-k-only", lambda x: _fp8(x, HEAD), _exact),
        Ablation("fp8-v-only", _exact, lambda x: _fp8(x, HEAD)),
        Ablation("fp8-per-channel", lambda x: _fp8(x, CHANNEL), lambda x: _fp8(x, CHANNEL)),
        Ablation("fp8-pow1.5", lambda x: _companded_fp8(x, 1.5, CHANNEL), lambda x: _companded_fp8(x, 1.5, CHANNEL)),
        Ablation("int8-k+fp8-v", lambda x: _int8(x, CHANNEL), lambda x: _fp8(x, HEAD)),
    )
}


@dataclass(frozen=True)
class Rope:
    """A model's rotary embedding at positions 0 .. n-1 (HF's rotate-half layout)."""

    cos: torch.Tensor  # [positions, head_dim], float32
    sin: torch.Tensor
    fast: np.ndarray  # [head_dim // 2] bool: pairs that turn more than 3 radians over `tokens`


def rope_of(model: Any, tokens: int) -> Rope:
    """`model`'s rotary embedding (an HF Llama-style `model.model.rotary_emb`) for `tokens` positions."""
    rotary = model.model.rotary_emb
    positions = torch.arange(tokens)[None]
    cos, sin = rotary(torch.zeros(1, tokens, 1), positions)
    return Rope(cos[0].float(), sin[0].float(), (rotary.inv_freq.float() * tokens > 3.0).numpy())


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class PreRope:
    """`inner` (a kv codec) with keys quantized before RoPE; `rope` is set once the model is loaded."""

    codec_id = CodecId.RAW  # never on the wire
    lossless = False

    def __init__(self, inner: Codec) -> None:
        self.inner = inner
        self.name = f"pre:{inner.name}"
        self.rope: Rope | None = None

    def _keys(self, data: bytes | memoryview, meta: TensorMeta, sign: float) -> bytes:
        """Keys [heads, tokens, head_dim] rotated by -position (sign -1: back to before RoPE) or +position."""
        assert self.rope is not None, "PreRope.rope is set from the model before use"
        dtype = TORCH_DTYPES[meta.dtype]
        x = torch.frombuffer(bytearray(data), dtype=dtype).view(meta.shape).float()
        tokens = meta.shape[1]
        turned = x * self.rope.cos[:tokens] + sign * _rotate_half(x) * self.rope.sin[:tokens]
        return tensor_bytes(turned.to(dtype))

    def _pair_weights(self, weights: Any) -> Any:
        if weights is None or self.rope is None:
            return weights
        w = np.array(weights, dtype=np.float32)
        half = w.shape[-1] // 2
        pair = (w[:, :half] + w[:, half:]) / 2
        w[:, :half] = np.where(self.rope.fast, pair, w[:, :half])
        w[:, half:] = np.where(self.rope.fast, pair, w[:, half:])
        return w

    def encode(self, data: bytes | memoryview, meta: TensorMeta) -> bytes:
        if meta.part == 1:
            return self.inner.encode(data, meta)
        meta = dataclasses.replace(meta, key_weights=self._pair_weights(meta.key_weights))
        return self.inner.encode(self._keys(data, meta, -1.0), meta)

    def decode(self, payload: bytes | memoryview, meta: TensorMeta) -> bytes:
        decoded = self.inner.decode(payload, meta)
        return decoded if meta.part == 1 else self._keys(decoded, meta, 1.0)
