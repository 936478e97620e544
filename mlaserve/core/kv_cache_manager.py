"""Block tables for every cache group of a model (full latent, sliding window, compressed entries), drawing from one
BlockPool shared by the groups or from a pool per group (groups whose pages differ in size: DeepSeek-V4's windows and
compressed entries). The scheduler talks only to KVCacheManager."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass

from mlaserve.core.block_hash import BlockHash, update_block_hashes
from mlaserve.core.block_pool import BlockPool, KVBlock
from mlaserve.core.request import Request


@dataclass(frozen=True)
class CacheGroupSpec:
    """One KV layout of the model. `kind` picks the manager, i.e. which blocks a request still needs."""

    group_id: int
    kind: str = "full"
    # Defaulted only so the field order above can stay (group_id, kind, block_size); 16 is vLLM's default.
    block_size: int = 16
    # kind "sliding_window": each token attends to itself and the window - 1 tokens before it,
    window: int | None = None
    # and to the first `sinks` tokens of the sequence (attention sinks, StreamingLLM), whose blocks it keeps.
    sinks: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.group_id, int) or self.group_id < 0:
            raise ValueError(f"CacheGroupSpec.group_id must be an int >= 0, got {self.group_id!r}")
        if not isinstance(self.block_size, int) or self.block_size <= 0:
            raise ValueError(f"CacheGroupSpec.block_size must be a positive int, got {self.block_size!r}")
        if self.kind not in MANAGER_KINDS:
            raise ValueError(f"CacheGroupSpec.kind must be one of {sorted(MANAGER_KINDS)}, got {self.kind!r}")
        if (self.kind == "sliding_window") != (self.window is not None):
            raise ValueError(
                f"CacheGroupSpec.window is set exactly for kind 'sliding_window', got {self.window!r}"
            )
        if self.window is not None and (not isinstance(self.window, int) or self.window < 1):
            raise ValueError(f"CacheGroupSpec.window must be an int >= 1, got {self.window!r}")
        if not isinstance(self.sinks, int) or self.sinks < 0 or (self.sinks and self.window is None):
            raise ValueError(
                f"CacheGroupSpec.sinks must be an int >= 0, set only with a window, got {self.sinks!r}"
            )


class SingleTypeManager(ABC):
    """Block tables of one cache group: req_id -> list of blocks, one per block_size tokens, positional.

    Subclasses decide what a prefix hit is and which blocks a request may give back early; allocation,
    hashing and freeing are shared. Seam for the sliding-window manager: it overrides
    `find_longest_cache_hit` (a hit only needs the last window of blocks), `remove_skipped_blocks` (swap
    blocks that left the window for the pool's null block, freeing them) and `max_blocks_per_request`.
    """

    def __init__(self, spec: CacheGroupSpec, pool: BlockPool, max_chunk_tokens: int | None = None) -> None:
        self.spec = spec
        self.max_chunk_tokens = max_chunk_tokens  # the most tokens one step may add (the scheduler's budget)
        self.group_id = spec.group_id
        self.block_size = spec.block_size
        self.pool = pool
        self.req_to_blocks: dict[str, list[KVBlock]] = {}
        # Leading blocks of each request already offered to the prefix cache, so each is hashed once.
        self._num_cached_blocks: dict[str, int] = {}

    @abstractmethod
    def find_longest_cache_hit(self, block_hashes: list[BlockHash], max_num_blocks: int) -> list[KVBlock]:
        """Cached blocks for a prefix of at most max_num_blocks blocks (as long as possible)."""

    @abstractmethod
    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Free the blocks that no future token of the request will attend to."""

    def max_blocks_per_request(self, num_tokens: int) -> int:
        """Most blocks a request of num_tokens holds at once (to reject requests that can never fit)."""
        return -(-num_tokens // self.block_size)

    def num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, new_computed_blocks: list[KVBlock]
    ) -> int:
        """Free-pool blocks needed to cover num_tokens: new blocks, plus hits that sit in the free queue
        (touching them takes them out of it just like an allocation)."""
        num_held = len(self.req_to_blocks.get(request_id, ())) + len(new_computed_blocks)
        num_new = max(0, -(-num_tokens // self.block_size) - num_held)
        null = self.pool.null_block
        return num_new + sum(1 for b in new_computed_blocks if b.ref_cnt == 0 and b is not null)

    def add_computed_blocks(self, request_id: str, blocks: list[KVBlock]) -> None:
        """Start the (empty) table of a request with prefix hits, already touched and already hashed."""
        self.req_to_blocks[request_id] = list(blocks)
        self._num_cached_blocks[request_id] = len(blocks)

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> None:
        table = self.req_to_blocks.setdefault(request_id, [])
        num_new = -(-num_tokens // self.block_size) - len(table)
        if num_new > 0:
            table.extend(self.pool.get_new_blocks(num_new))

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Hash and register every block that is full within the first num_tokens (known) tokens."""
        request_id = request.request_id
        num_full = num_tokens // self.block_size
        start = self._num_cached_blocks.get(request_id, 0)
        if num_full <= start:
            return
        hashes = update_block_hashes(request, self.block_size, self.group_id)
        table = self.req_to_blocks[request_id]
        null = self.pool.null_block
        for i in range(start, num_full):
            if table[i] is not null:  # a window already gave it back
                self.pool.cache_full_block(table[i], hashes[i])
        self._num_cached_blocks[request_id] = num_full

    def trim(self, request_id: str, num_tokens: int) -> None:
        """Give back the tail blocks past those num_tokens need (slots of rejected speculative drafts). Such a
        block was never offered to the prefix cache: only blocks full of known tokens are."""
        table = self.req_to_blocks.get(request_id)
        keep = -(-num_tokens // self.block_size)
        if not table or len(table) <= keep:
            return
        tail = table[keep:]
        del table[keep:]
        self.pool.free_blocks(reversed(tail))

    def free(self, request_id: str) -> None:
        # Tail first: the queue evicts from its front, so a prompt's prefix blocks outlive its tail blocks.
        table = self.req_to_blocks.pop(request_id, [])
        self._num_cached_blocks.pop(request_id, None)
        self.pool.free_blocks(reversed(table))

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    @property
    def num_held_blocks(self) -> int:
        """Blocks this group's tables hold now (the null block aside), all requests together."""
        null = self.pool.null_block
        return sum(1 for table in self.req_to_blocks.values() for b in table if b is not null)


class FullAttentionManager(SingleTypeManager):
    """Every token attends to every earlier token: keep all blocks; a hit is any chain of cached blocks."""

    def find_longest_cache_hit(self, block_hashes: list[BlockHash], max_num_blocks: int) -> list[KVBlock]:
        hits: list[KVBlock] = []
        for i in range(min(max_num_blocks, len(block_hashes))):
            block = self.pool.get_cached_block(block_hashes[i])
            if block is None:
                break
            hits.append(block)
        return hits

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        return None


class SlidingWindowManager(SingleTypeManager):
    """Each token attends to the last `window` tokens (itself included): a block whose tokens all lie before the
    next query's window goes back to the pool in the step it leaves the window, and the null block takes its place
    in the table, so tables stay positional and a request's live blocks stay flat however long it runs."""

    def __init__(self, spec: CacheGroupSpec, pool: BlockPool, max_chunk_tokens: int | None = None) -> None:
        super().__init__(spec, pool, max_chunk_tokens)
        self.window = spec.window
        self.sink_blocks = -(-spec.sinks // self.block_size)  # kept for the request's whole life

    def _first_needed_block(self, num_computed_tokens: int) -> int:
        # The next query sits at position num_computed_tokens and reads keys from num_computed_tokens - window + 1.
        return max(0, num_computed_tokens - self.window + 1) // self.block_size

    def find_longest_cache_hit(self, block_hashes: list[BlockHash], max_num_blocks: int) -> list[KVBlock]:
        """The longest prefix whose sink blocks and last blocks (those the next token's window reads) are all
        cached; the blocks between are not needed, and stand as null blocks."""
        null = self.pool.null_block
        for n in range(min(max_num_blocks, len(block_hashes)), 0, -1):
            first = max(self._first_needed_block(n * self.block_size), min(self.sink_blocks, n))
            sinks = [self.pool.get_cached_block(h) for h in block_hashes[: min(self.sink_blocks, n)]]
            run = [self.pool.get_cached_block(h) for h in block_hashes[first:n]]
            if all(block is not None for block in sinks + run):
                return sinks + [null] * (first - len(sinks)) + run
        return []

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        table = self.req_to_blocks.get(request_id)
        if not table:
            return
        null = self.pool.null_block
        leaving = []
        for i in range(self.sink_blocks, min(self._first_needed_block(num_computed_tokens), len(table))):
            if table[i] is not null:
                leaving.append(table[i])
                table[i] = null
        self.pool.free_blocks(leaving)  # oldest first: the first to be evicted among them

    def max_blocks_per_request(self, num_tokens: int) -> int:
        full = -(-num_tokens // self.block_size)
        if self.max_chunk_tokens is None:
            return full
        # The sink blocks, the window before a step's first new token, that step's tokens, and one block of
        # misalignment.
        span = self.window - 1 + self.max_chunk_tokens
        return min(full, self.sink_blocks + -(-span // self.block_size) + 1)


MANAGER_KINDS: dict[str, type[SingleTypeManager]] = {
    "full": FullAttentionManager,
    "sliding_window": SlidingWindowManager,
}


class KVCacheManager:
    """Allocates, prefix-caches and frees the blocks of every cache group for each request.

    num_blocks as an int: one pool that every group draws from (every layer's tensor has a row per block id). As a
    list, one per group: each group has a pool of its own, so a group's block ids index only its own tensors and its
    pages can be sized to its own layers' rows; a request is admitted when every pool can give its group's blocks.
    """

    def __init__(
        self,
        groups: list[CacheGroupSpec],
        num_blocks: int | list[int],
        enable_caching: bool,
        max_chunk_tokens: int | None = None,
    ) -> None:
        if not groups:
            raise ValueError("KVCacheManager needs at least one CacheGroupSpec in groups")
        group_ids = [g.group_id for g in groups]
        if len(set(group_ids)) != len(group_ids):
            raise ValueError(f"CacheGroupSpec.group_id must be unique across groups, got {group_ids}")
        self.groups = list(groups)
        self.enable_caching = enable_caching
        if isinstance(num_blocks, list):
            if len(num_blocks) != len(groups):
                raise ValueError(
                    f"num_blocks needs one count per cache group ({len(groups)}), got {num_blocks}"
                )
            self.pools = [BlockPool(n, enable_caching) for n in num_blocks]
        else:
            self.pools = [BlockPool(num_blocks, enable_caching)]
        self.block_pool = self.pools[0]  # the shared pool, or the first group's
        group_pools = self.pools if len(self.pools) == len(groups) else self.pools * len(groups)
        self.managers = [
            MANAGER_KINDS[g.kind](g, pool, max_chunk_tokens)
            for g, pool in zip(self.groups, group_pools, strict=True)
        ]
        # A hit must end on a block boundary of every group.
        self._hit_granularity = math.lcm(*(g.block_size for g in self.groups))
        self._num_queries = 0
        self._num_hits = 0
        # Lookups count towards the stats only once the request is admitted with them: a request that
        # waits for memory is looked up every step and would otherwise flood the hit rate.
        self._pending_lookups: dict[str, tuple[int, int]] = {}
        # A draft layer's cache row at a position is made from the token after it (DeepSeek's MTP): the last row of
        # a hit was made with the next block's first token, which the request may not share, so hits stop a
        # block short and that block is recomputed.
        self.drop_last_hit_block = False

    @property
    def num_free_blocks(self) -> int:
        return sum(pool.num_free_blocks for pool in self.pools)

    @property
    def num_used_blocks(self) -> int:
        return sum(pool.num_used_blocks for pool in self.pools)

    @property
    def num_total_blocks(self) -> int:
        return sum(pool.num_blocks - 1 for pool in self.pools)

    @property
    def usage(self) -> float:
        """The fullest pool's share in use: the one that refuses the next request first."""
        return max(pool.usage for pool in self.pools)

    def max_blocks_per_request(self, num_tokens: int) -> int:
        return sum(m.max_blocks_per_request(num_tokens) for m in self.managers)

    def shortfall(self, num_tokens: int) -> list[tuple[int, int]]:
        """(blocks needed, usable blocks) of each pool that cannot hold one request of num_tokens tokens alone."""
        out = []
        for pool in self.pools:
            needed = sum(m.max_blocks_per_request(num_tokens) for m in self.managers if m.pool is pool)
            if needed > pool.num_blocks - 1:
                out.append((needed, pool.num_blocks - 1))
        return out

    def get_computed_blocks(self, request: Request) -> tuple[list[list[KVBlock]], int]:
        """Longest prefix-cache hit per group (not yet touched) and the number of tokens it covers.

        At most num_tokens - 1 tokens: the last token is always recomputed, its logits are needed.
        The lookup enters the stats when allocate_slots succeeds for the request (once per admission).
        """
        empty: list[list[KVBlock]] = [[] for _ in self.managers]
        if not self.enable_caching or request.num_computed_tokens > 0 or not request.read_prefix_cache:
            return empty, 0
        hashes = [update_block_hashes(request, m.block_size, m.group_id) for m in self.managers]
        step = self._hit_granularity
        hits, hit_tokens = self._longest_hit(hashes, (request.num_tokens - 1) // step * step)
        if self.drop_last_hit_block and hit_tokens:
            # Looked up again at the shorter length, not cut: a window group's hit at that length needs the
            # blocks of its own window, which the longer hit left as null blocks.
            hits, hit_tokens = self._longest_hit(hashes, hit_tokens - step)
        self._pending_lookups[request.request_id] = (request.num_tokens, hit_tokens)
        return (hits if hit_tokens else empty), hit_tokens

    def _longest_hit(
        self, hashes: list[list[BlockHash]], max_hit_tokens: int
    ) -> tuple[list[list[KVBlock]], int]:
        """Each group's hit blocks and the tokens they cover: the longest prefix of at most max_hit_tokens (a
        multiple of the hit granularity) that every group serves."""
        step = self._hit_granularity
        while True:
            hits = [
                m.find_longest_cache_hit(h, max_hit_tokens // m.block_size)
                for m, h in zip(self.managers, hashes, strict=True)
            ]
            lengths = [len(b) * m.block_size for b, m in zip(hits, self.managers, strict=True)]
            hit_tokens = min(lengths) // step * step
            if all(n == hit_tokens for n in lengths):
                break
            # Groups disagree: ask all of them again at the shortest length (a later sliding-window group
            # may not hit at a shorter length even if it did at a longer one).
            max_hit_tokens = hit_tokens
        return hits, hit_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[list[KVBlock]] | None = None,
        cache: bool = True,
    ) -> list[list[int]] | None:
        """Give the request slots for its first num_computed_tokens + hits + num_new_tokens tokens.

        new_computed_blocks are get_computed_blocks' hits; the tokens they cover are added to
        request.num_computed_tokens by the caller after success. Returns the whole block table per group,
        or None, with nothing changed, when the pool is short. cache=False leaves the new full blocks out of the
        prefix cache, for a caller that may not run the step (cache_blocks offers them once it will).
        """
        if num_new_tokens <= 0:
            raise ValueError(f"num_new_tokens must be positive, got {num_new_tokens}")
        request_id = request.request_id
        hits = new_computed_blocks  # None / empty for a running request's next tokens, every decode step
        num_computed = request.num_computed_tokens
        if hits:
            if len(hits) != len(self.managers):
                raise ValueError(
                    f"new_computed_blocks needs one list per cache group ({len(self.managers)}), got {len(hits)}"
                )
            if any(hits) and any(m.req_to_blocks.get(request_id) for m in self.managers):
                raise ValueError(
                    f"request {request_id!r} already has blocks; prefix hits can only start a table"
                )
            num_computed += len(hits[0]) * self.managers[0].block_size
        num_tokens = num_computed + num_new_tokens
        # Giving back out-of-window blocks first is safe even if we then fail: nobody needs them.
        for manager in self.managers:
            manager.remove_skipped_blocks(request_id, num_computed)
        needed = dict.fromkeys(map(id, self.pools), 0)
        for i, manager in enumerate(self.managers):
            needed[id(manager.pool)] += manager.num_blocks_to_allocate(
                request_id, num_tokens, hits[i] if hits else ()
            )
        if any(needed[id(pool)] > pool.num_free_blocks for pool in self.pools):
            return None
        if hits:
            # Touch every group's hits before allocating anything, or an allocation could evict a hit.
            for manager, group_hits in zip(self.managers, hits, strict=True):
                if group_hits:
                    manager.pool.touch(group_hits)
                    manager.add_computed_blocks(request_id, group_hits)
        for manager in self.managers:
            manager.allocate_new_blocks(request_id, num_tokens)
        if cache:
            # Hashed now, though the KV is written by this step's forward: a request scheduled later in the
            # same step may hit these blocks, which is sound because each layer writes the whole batch's
            # KV before any attention of that layer reads the cache.
            self.cache_blocks(request, num_tokens)
        lookup = self._pending_lookups.pop(request_id, None)
        if lookup is not None:
            self._num_queries += lookup[0]
            self._num_hits += lookup[1]
        return self.get_block_ids(request_id)

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Offer the request's blocks that are full within its first num_tokens tokens (the known ones) to the
        prefix cache. Only for a step that will run: a hit on a block skips computing it."""
        if not self.enable_caching:
            return
        num_known = min(num_tokens, request.num_tokens)
        for manager in self.managers:
            manager.cache_blocks(request, num_known)

    def free_skipped(self, request: Request, ahead: int = 0) -> None:
        """Give back the blocks no future token of the request reads (those that left a window), now that its
        computed tokens moved on: the step they leave the window, not at the next allocation. ahead: tokens a step
        still in flight computes, for a step scheduled behind it; that step may still read these blocks, but any
        new owner's KV is written by a later step, which the device runs after it."""
        for manager in self.managers:
            manager.remove_skipped_blocks(request.request_id, request.num_computed_tokens + ahead)

    def trim(self, request: Request, num_tokens: int) -> None:
        """Keep only the blocks the request's first num_tokens tokens need, in every group."""
        for manager in self.managers:
            manager.trim(request.request_id, num_tokens)

    def free(self, request: Request) -> None:
        self._pending_lookups.pop(request.request_id, None)
        for manager in self.managers:
            manager.free(request.request_id)

    def get_block_ids(self, request_id: str) -> list[list[int]]:
        return [m.block_ids(request_id) for m in self.managers]

    def blocks_per_group(self) -> list[int]:
        """Blocks each group's tables hold now."""
        return [m.num_held_blocks for m in self.managers]

    def prefix_cache_stats(self) -> dict[str, int]:
        return {"queries": self._num_queries, "hits": self._num_hits}

    def reset_prefix_cache(self) -> bool:
        # All pools or none: a half-reset cache would still hit on the other pools' old hashes.
        if any(pool.num_used_blocks for pool in self.pools):
            return False
        return all([pool.reset_prefix_cache() for pool in self.pools])
