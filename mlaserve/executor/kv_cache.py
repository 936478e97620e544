"""The KV cache an executor plans and allocates: the model's cache spec (with the training-free window, pooling
and block-sparse options applied), its cache groups, the block count, the manager over them and the tensors."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from mlaserve.attention.pooled_window import PooledWindow
from mlaserve.config.engine_config import CacheOptions
from mlaserve.core.kv_cache_manager import CacheGroupSpec, KVCacheManager
from mlaserve.executor.kv_sizing import group_kv_blocks, num_kv_blocks
from mlaserve.kvcache.allocate import allocate_group_caches, allocate_kv_caches
from mlaserve.kvcache.quant import resolve_cache_dtype
from mlaserve.kvcache.spec import AttentionRule, KVCacheSpec
from mlaserve.models.base import CausalLM
from mlaserve.parallel import ParallelContext


def with_sliding_window(spec: KVCacheSpec, window: int | None, sinks: int) -> KVCacheSpec:
    """The training-free window option: every full-attention layer takes (window, sinks); layers the model itself
    windows keep their own rule."""
    if window is None:
        return spec
    layers = [
        dataclasses.replace(layer, window=window, sinks=sinks) if layer.window is None else layer
        for layer in spec.layers
    ]
    return dataclasses.replace(spec, layers=tuple(layers))


@dataclass
class KVCache:
    spec: KVCacheSpec
    group_rules: list[AttentionRule]  # one per cache group: its window, sinks, pooling ratio
    dtype: torch.dtype
    block_size: int
    manager: KVCacheManager
    tensors: list  # one per layer: a tensor, or with a pool per group (rows, entries) for a compressing layer

    @property
    def bytes_per_token(self) -> float:
        return self.spec.context_bytes_per_token(self.dtype)

    @property
    def num_blocks(self) -> int:
        """Usable blocks (the null blocks left out), of every pool."""
        return self.manager.num_total_blocks

    @property
    def capacity_tokens(self) -> int:
        """Tokens of context the cache holds: a block per block_size tokens of one pool or, with a pool per group,
        what the fullest entry group can hold (its blocks span block_size x ratio tokens); the window groups' pools
        bound how many requests run at once, not their length."""
        if not self.spec.pool_per_group:
            return self.num_blocks * self.block_size
        first = len(self.group_rules) - len(self.spec.entry_rules)
        pools = self.manager.pools[first:]
        return min(
            (pool.num_blocks - 1) * self.block_size * rule.ratio
            for pool, rule in zip(pools, self.spec.entry_rules, strict=True)
        )

    def group_descriptions(self) -> list[str]:
        """Each cache group, e.g. "full: 7 layers, 3584 bytes/token" or "window 64: 21 layers, ..."."""
        groups = self.spec.layer_groups()
        sizes = self.spec.group_bytes_per_token(self.dtype)
        index = self.spec.group_bytes_per_token(self.dtype, index_only=True)
        slots = self.spec.group_slot_bytes(self.dtype)
        out = []
        for g, rule in enumerate(self.group_rules):
            if rule.ratio:
                source = self.group_rules.index(dataclasses.replace(rule, ratio=None, span=None))
                # With a pool per group an entry holds its own layers' entries; else a slot of every layer.
                size = slots[g] if self.spec.pool_per_group else sizes[source]
                out.append(f"pooled 1:{rule.ratio} of group {source}: {size} bytes/entry")
                continue
            kind = "full" if rule.window is None else f"window {rule.window}"
            kind += f" + {rule.sinks} sink tokens" if rule.sinks else ""
            text = f"{kind}: {groups.count(g)} layers, {sizes[g]} bytes/token"
            out.append(text + (f" ({index[g]} of them indexer keys)" if index[g] else ""))
        return out

    def describe(self, model_dtype: torch.dtype) -> str:
        """The start-up log's line: capacity, bytes per token (beside what per-head K/V would cost) and, where there
        is more than one plain group, the groups."""
        if self.spec.pool_per_group:
            pools = ", ".join(str(pool.num_blocks - 1) for pool in self.manager.pools)
            line = (
                f"KV cache: pools of {pools} blocks x {self.block_size} slots (one per group) = "
                f"{self.capacity_tokens} tokens, {self.bytes_per_token} bytes/token ({self.dtype})"
            )
        else:
            line = (
                f"KV cache: {self.num_blocks} blocks x {self.block_size} tokens = {self.capacity_tokens} tokens, "
                f"{self.bytes_per_token} bytes/token ({self.dtype})"
            )
        if self.spec.mha_elements_per_layer:
            mha = self.spec.mha_bytes_per_token(model_dtype)
            line += f"; per-head K/V would cost {mha} bytes/token ({mha / self.bytes_per_token:.1f}x)"
        rules = self.group_rules
        if (
            len(rules) > 1
            or rules[0].window is not None
            or any(self.spec.group_bytes_per_token(self.dtype, True))
        ):
            line += "; cache groups: " + ", ".join(self.group_descriptions())
        return line


def build_kv_cache(
    config: CacheOptions,
    model: CausalLM,
    model_dtype: torch.dtype,
    max_model_len: int,
    max_step_tokens: int,
    device: torch.device,
    parallel: ParallelContext,
    max_num_seqs: int = 256,
) -> KVCache:
    """Tell the model its cache groups, size the pool from the budget and allocate it."""
    window, ratio, sinks = config.sliding_window, config.compress_ratio, config.num_sink_tokens
    if ratio:
        # A query sees exactly back to the start of the group its window begins in: window + ratio - 1 tokens
        # stay in the window group; older ones live on as pooled entries, in a group of their own.
        window += ratio - 1
    spec = with_sliding_window(model.kv_cache_spec(), window, sinks)
    model.set_cache_groups(spec.layer_groups())
    rules = spec.group_rules()
    if ratio:
        source = AttentionRule(window, sinks)
        rules.append(dataclasses.replace(source, ratio=ratio))
        rule = PooledWindow(config.sliding_window, ratio, sinks)
        model.set_pooled_window(rule, rules.index(source), len(rules) - 1)
    if config.index_topk:
        model.set_block_topk(config.index_topk)
    dtype = resolve_cache_dtype(config.kv_cache_dtype, model_dtype, spec.takes_8bit)
    block_size = config.block_size
    num_blocks: int | list[int]
    if spec.pool_per_group:
        own = own_group_blocks(rules, block_size, max_num_seqs, max_step_tokens, max_model_len)
        num_blocks = group_kv_blocks(config, spec, dtype, device, own)
    else:
        num_blocks = num_kv_blocks(config, spec, dtype, device)
    if parallel.distributed:  # every rank's cache has the same blocks: the smallest budget decides
        from mlaserve.parallel.group import min_over_ranks

        if isinstance(num_blocks, list):
            num_blocks = [min_over_ranks(parallel, n) for n in num_blocks]
        else:
            num_blocks = min_over_ranks(parallel, num_blocks)
    groups = [
        # A pooled group's block holds block_size entries, i.e. spans block_size x ratio tokens.
        CacheGroupSpec(i, "full", block_size * r.ratio)
        if r.ratio
        else CacheGroupSpec(
            i, "full" if r.window is None else "sliding_window", block_size, r.window, r.sinks
        )
        for i, r in enumerate(rules)
    ]
    manager = KVCacheManager(groups, num_blocks, config.enable_prefix_caching, max_step_tokens)
    # One request of max_model_len tokens must fit alone: every group's blocks for it (a window group's stay
    # bounded by its window), from its pool.
    for needed, usable in manager.shortfall(max_model_len):
        raise ValueError(
            f"the KV cache has {usable} blocks of {block_size} tokens; one request of "
            f"max_model_len={max_model_len} tokens needs {needed}: raise the KV budget "
            "(kv_cache_memory_bytes / gpu_memory_utilization / num_kv_blocks) or lower max_model_len"
        )
    if isinstance(num_blocks, list):
        tensors = allocate_group_caches(spec, num_blocks, block_size, dtype, device)
    else:
        tensors = allocate_kv_caches(spec, num_blocks, block_size, dtype, device)
    return KVCache(spec, rules, dtype, block_size, manager, tensors)


def own_group_blocks(
    rules: list[AttentionRule], block_size: int, max_num_seqs: int, max_step_tokens: int, max_model_len: int
) -> int:
    """The most blocks the layers' own groups (not entry groups) hold at once over the running requests: each
    request its window's and sinks' blocks and two more (its next token, misalignment), plus the step's new tokens.
    A full group's requests may hold max_model_len each."""
    most = 0
    for rule in rules:
        if rule.ratio:
            continue
        if rule.window is None:
            per_request = -(-max_model_len // block_size)
        else:
            per_request = -(-rule.sinks // block_size) + -(-(rule.window - 1) // block_size) + 2
        most = max(most, max_num_seqs * per_request + -(-max_step_tokens // block_size))
    return most
