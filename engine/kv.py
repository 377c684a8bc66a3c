"""The `KVCache` data model: what a prefill hands to a decode.

One request's attention keys and values after its prompt, plus enough identity to refuse
a cache that does not belong to the decoding model. Batch size is always one: a cache is
one request's, and batching happens in the engines, not on the wire.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import xxhash

from prfaas.engine.blocks import token_bytes

# Names on the wire and in fingerprints; torch dtypes stay inside the process.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def dtype_name(dtype: torch.dtype) -> str:
    for name, value in DTYPES.items():
        if value == dtype:
            return name
    raise ValueError(f"unsupported KV dtype {dtype}; supported: {', '.join(DTYPES)}")


def byte_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy (the view keeps the tensor alive)."""
    array: Any = tensor.reshape(-1).view(torch.uint8).numpy()
    return memoryview(array)


def tensor_view(buf: bytes | bytearray | memoryview, shape: tuple[int, int, int], dtype: torch.dtype) -> torch.Tensor:
    """A tensor of `shape` and `dtype` over `buf`'s bytes, without a copy."""
    view = memoryview(buf).cast("B")
    flat = torch.frombuffer(view, dtype=torch.uint8) if view.nbytes else torch.empty(0, dtype=torch.uint8)
    return flat.view(dtype).view(shape)


def hash_token_ids(token_ids: Sequence[int]) -> str:
    """xxh3-64 of the token ids as little-endian int32, in hex: ties a cache to its prompt. InvalidPrompt
    for an id outside int32."""
    return xxhash.xxh3_64_hexdigest(token_bytes(token_ids))


@dataclass(frozen=True)
class LayerKV:
    """One decoder layer's cache.

    k, v: [num_kv_heads, num_tokens, head_dim], contiguous, in the cache's dtype.
    """

    k: torch.Tensor
    v: torch.Tensor


@dataclass(frozen=True)
class KVCache:
    """A prompt's KV cache, as produced by `Engine.prefill` and consumed by `Engine.decode`.

    model_fingerprint: `Engine.fingerprint` of the producing model (config + weights).
    dtype: one of `DTYPES`' names; every tensor in `layers` has it.
    layers: one `LayerKV` per decoder layer, in layer order.
    num_tokens: tokens covered, equal to every tensor's dim 1.
    token_ids_hash: `hash_token_ids` of the prompt the cache was computed from.
    """

    model_fingerprint: str
    dtype: str
    layers: tuple[LayerKV, ...]
    num_tokens: int
    token_ids_hash: str

    def __post_init__(self) -> None:
        # Internal invariant: constructors in this package build consistent caches.
        expected = DTYPES[self.dtype]
        for layer in self.layers:
            assert layer.k.dtype == expected and layer.v.dtype == expected
            assert layer.k.shape == layer.v.shape and layer.k.dim() == 3
            assert layer.k.shape[1] == self.num_tokens

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def nbytes(self) -> int:
        """Bytes of K and V over all layers (the raw payload size)."""
        return sum(t.numel() * t.element_size() for layer in self.layers for t in (layer.k, layer.v))

    @property
    def bytes_per_token(self) -> int:
        return self.nbytes // self.num_tokens if self.num_tokens else 0
