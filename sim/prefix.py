"""A modelled region's prefix cache: what its engine would hold, in the terms the live system
publishes and the scheduler reads (Region.cached_prefix_hashes, Request.prefix_block_hashes).

A workload that models prompts as chains of blocks (sim/workload.py `MultiTurn`: a shared system
prompt, then each conversation's history) names each full block; two prompts share a block name
exactly when they share every token up to its end, like the chained digests of engine/blocks.py.
A region keeps the blocks of the prompts it prefilled and, after a decode, of the prompt and its
reply; the least recently used go first past `capacity_blocks`, a chain's tail before its head
(engine/prefix_cache.py's rule), so the scheduler runs on the same signal as in the live system.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class PrefixModel:
    def __init__(self, capacity_blocks: int) -> None:
        self.capacity_blocks = capacity_blocks
        self._blocks: OrderedDict[str, None] = OrderedDict()  # least recently used first
        self._resident: tuple[int, frozenset[str]] = (-1, frozenset())
        self.version = 0

    def held(self, chain: Sequence[str]) -> int:
        """How many of `chain`'s leading blocks are held."""
        count = 0
        for name in chain:
            if name not in self._blocks:
                break
            count += 1
        return count

    def keep(self, chain: Sequence[str]) -> None:
        """Hold `chain`'s blocks, its head most recently used; evict past the capacity."""
        if self.capacity_blocks <= 0 or not chain:
            return
        for name in reversed(chain):
            self._blocks[name] = None
            self._blocks.move_to_end(name)
        while len(self._blocks) > self.capacity_blocks:
            self._blocks.popitem(last=False)
        self.version += 1

    @property
    def resident(self) -> frozenset[str]:
        """Every held block: what the region's heartbeat publishes (rebuilt once per change)."""
        if self._resident[0] != self.version:
            self._resident = (self.version, frozenset(self._blocks))
        return self._resident[1]
