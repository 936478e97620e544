"""KV blocks and the pool that hands them out with an LRU free queue."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from mlaserve.core.block_hash import BlockHash


@dataclass(slots=True, eq=False)
class KVBlock:
    """One block of KV-cache slots. Identity equality: the pool tracks block objects, not values."""

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None


class BlockPool:
    """Owns every KV block; hands out free ones and keeps freed full blocks findable by hash until reused.

    Block 0 is the null block: never allocated, never freed, it stands in for table entries that hold no
    KV (sliding-window holes), so block tables stay positional. Usable blocks are 1..num_blocks-1.

    A block is in exactly one state: in use (ref_cnt > 0) or in the free queue (ref_cnt == 0). A free block
    that still has a hash is a prefix-cache hit waiting to happen; it loses the hash only when it is
    reallocated (evicted), least recently freed first.
    """

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 2:
            raise ValueError(
                f"num_blocks must be an int >= 2 (block 0 is the reserved null block), got {num_blocks!r}"
            )
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(block_id=i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        # OrderedDict gives O(1) popleft, append and removal from the middle (a touched cached block).
        self._free_queue: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks[1:])
        # One block per hash. A second block with the same hash (two requests computed the same prefix
        # at once) is not registered: block tables are append-only, so we cannot dedupe it in place, and
        # a single owner per hash keeps eviction a dict delete.
        self._cached: dict[BlockHash, KVBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be allocated now, counting cached blocks that would be evicted."""
        return len(self._free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - 1 - len(self._free_queue)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / (self.num_blocks - 1)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def get_new_blocks(self, num_blocks: int) -> list[KVBlock]:
        """Pop blocks from the front of the free queue (evicting their cached hash), each with ref_cnt 1."""
        if num_blocks > len(self._free_queue):
            raise ValueError(f"cannot allocate {num_blocks} blocks: only {len(self._free_queue)} free")
        blocks = []
        for _ in range(num_blocks):
            _, block = self._free_queue.popitem(last=False)
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        if not self.enable_caching:
            return None
        return self._cached.get(block_hash)

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on prefix-hit blocks; a hit that was free leaves the free queue (no eviction)."""
        for block in blocks:
            if block is self.null_block:
                continue
            if block.ref_cnt == 0:
                del self._free_queue[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVBlock]) -> None:
        """Drop a reference on each block; blocks reaching 0 join the queue tail in the order given,
        so the first block passed is the first to be evicted among them."""
        for block in ordered_blocks:
            if block is self.null_block:
                continue
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of KV block {block.block_id}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free_queue[block.block_id] = block

    def cache_full_block(self, block: KVBlock, block_hash: BlockHash) -> None:
        """Register a block whose tokens are all known (KV written this step) as a prefix-cache entry."""
        if not self.enable_caching or block.block_hash is not None or block_hash in self._cached:
            return
        block.block_hash = block_hash
        self._cached[block_hash] = block

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash (e.g. after a weight update). Refused (False) while blocks are in use,
        as running requests would keep registering hashes of KV computed with the old weights."""
        if self.num_used_blocks > 0:
            return False
        for block in self._cached.values():
            block.block_hash = None
        self._cached.clear()
        return True

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None and self._cached.get(block.block_hash) is block:
            del self._cached[block.block_hash]
        block.block_hash = None
