"""`PrefixCache`: the HF engine's block-granular prefix cache, in both region roles.

Blocks of `block_tokens` prompt tokens (engine/blocks.py) keyed by their chained digest,
each holding that block's K and V in every layer. A lookup finds the longest run of a
prompt's leading blocks held here; since digests are chained, a block is useful only after
its predecessors, so the run is a prefix. Least recently used blocks leave first once the
blocks' bytes pass `max_bytes` (a block someone still uses stays alive through its tensors:
eviction only drops the cache's reference).

What enters: KV that a lossless path produced for exactly these tokens (a prefill here, a
shipment decoded without loss, a decode's own steps). KV decoded from a lossy codec never
enters, so a later request that did not consent to a lossy codec never reads it.

Thread-safe: one lock around the index; tensors are built outside it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from prfaas.engine.blocks import short

# One block's K and V over all layers: [num_layers, 2, num_kv_heads, block_tokens, head_dim]
BlockKV = torch.Tensor


@dataclass(frozen=True)
class Hit:
    """The cached run of a prompt's leading blocks: their KV, by layer, concatenated."""

    num_blocks: int
    num_tokens: int
    layers: tuple[tuple[torch.Tensor, torch.Tensor], ...]  # per layer (k, v): [kv_heads, num_tokens, head_dim]


class PrefixCache:
    def __init__(self, block_tokens: int, max_bytes: int, publish_limit: int = 4096) -> None:
        if block_tokens < 1 or max_bytes < 0:
            raise ValueError("block_tokens must be >= 1 and max_bytes >= 0")
        self.block_tokens = block_tokens
        self.max_bytes = max_bytes
        self.publish_limit = publish_limit
        self._lock = threading.Lock()
        self._blocks: OrderedDict[bytes, BlockKV] = OrderedDict()  # least recently used first
        self._bytes = 0
        self.version = 0  # bumps whenever the set of resident blocks changes
        self.hits = 0  # blocks served from here, since start
        self.misses = 0  # blocks looked up and computed

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._blocks)

    def lookup(self, digests: Sequence[bytes]) -> Hit | None:
        """The longest cached run of `digests`' leading blocks (touched: used most recently), or None."""
        with self._lock:
            found: list[BlockKV] = []
            for digest in digests:
                block = self._blocks.get(digest)
                if block is None:
                    break
                found.append(block)
            self._touch(digests[: len(found)])
            self.hits += len(found)
            self.misses += len(digests) - len(found)
        if not found:
            return None
        joined = torch.cat(found, dim=3) if len(found) > 1 else found[0]  # [layers, 2, heads, tokens, dim]
        layers = tuple((joined[i, 0], joined[i, 1]) for i in range(joined.shape[0]))
        return Hit(len(found), len(found) * self.block_tokens, layers)

    def insert(self, digests: Sequence[bytes], layers: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> int:
        """Keep block i of `layers` (per layer (k, v): [kv_heads, tokens, head_dim], covering at least
        len(digests) blocks from token 0) under digests[i]; blocks already held are only touched.
        Returns the blocks added."""
        if self.max_bytes == 0 or not digests:
            return 0
        step = self.block_tokens
        with self._lock:
            missing = [i for i, d in enumerate(digests) if d not in self._blocks]
        made = {
            i: torch.stack([torch.stack((k[:, i * step : (i + 1) * step], v[:, i * step : (i + 1) * step]))
                            for k, v in layers]).contiguous()
            for i in missing
        }  # fmt: skip
        added = 0
        with self._lock:
            for i, digest in enumerate(digests):
                if digest in self._blocks:
                    continue
                if i not in made:  # held at the first look, evicted since by another insert: the chain breaks
                    break  # here (a block after it could never be found: lookups stop at the first miss)
                self._blocks[digest] = made[i]
                self._bytes += made[i].numel() * made[i].element_size()
                added += 1
            self._touch(digests)
            evicted = 0
            while self._bytes > self.max_bytes and self._blocks:
                _, old = self._blocks.popitem(last=False)
                self._bytes -= old.numel() * old.element_size()
                evicted += 1
            if added or evicted:
                self.version += 1
        return added

    def _touch(self, digests: Sequence[bytes]) -> None:
        """Mark a chain used, its first block most recently: eviction takes a chain's tail first, and
        a block is never dropped while a later block of its chain stays (it would be unreachable).
        Call with the lock held."""
        for digest in reversed(digests):
            if digest in self._blocks:
                self._blocks.move_to_end(digest)

    def resident(self) -> list[str]:
        """The short digests (engine/blocks.py `short`) of the most recently used blocks, at most
        `publish_limit`, most recent first: what the region publishes."""
        with self._lock:
            recent = list(self._blocks)[-self.publish_limit :]
        return [short(d) for d in reversed(recent)]

    def clear(self) -> None:
        with self._lock:
            self._blocks.clear()
            self._bytes = 0
            self.version += 1


class Residency(Protocol):
    """What a region's heartbeats publish of its prefix cache (region/server.py)."""

    @property
    def version(self) -> int: ...

    def resident(self) -> list[str]: ...


class ResidencyMirror:
    """What a vLLM engine's own prefix cache holds, as far as the region can tell: the blocks of
    the prompts (and replies) it sent the engine, least recently used out past `capacity_blocks`
    (the engine's KV cache in blocks of `block_tokens`), a chain's tail first, as vLLM's
    automatic prefix caching evicts. An approximation: vLLM frees blocks by its own counts, so
    a block published here may be gone (the request then computes it; the output is the same)."""

    def __init__(self, block_tokens: int, capacity_blocks: int, publish_limit: int = 4096) -> None:
        self.block_tokens = block_tokens
        self.capacity_blocks = capacity_blocks
        self.publish_limit = publish_limit
        self._lock = threading.Lock()
        self._blocks: OrderedDict[bytes, None] = OrderedDict()
        self.version = 0

    def keep(self, digests: Sequence[bytes]) -> None:
        if not digests or self.capacity_blocks <= 0:
            return
        with self._lock:
            for digest in reversed(digests):  # the chain's head most recently used
                self._blocks[digest] = None
                self._blocks.move_to_end(digest)
            while len(self._blocks) > self.capacity_blocks:
                self._blocks.popitem(last=False)
            self.version += 1

    def resident(self) -> list[str]:
        with self._lock:
            recent = list(self._blocks)[-self.publish_limit :]
        return [short(d) for d in reversed(recent)]
