"""What each layer caches per token, and how many bytes that costs."""

from dataclasses import dataclass

import torch

from mlaserve.kvcache.quant import row_width


@dataclass(frozen=True)
class AttentionRule:
    """Which cached tokens a query attends to: all earlier ones (window None), or the last `window` (itself
    included) plus the sequence's first `sinks` tokens. Layers with the same rule form one cache group.

    With `ratio`, the group is not a layer's own but the pooled entries of the (window, sinks) group's layers: one
    entry per `ratio` tokens, `block_size` entries a block (the engine's compress_ratio, attention/pooled_window.py;
    DeepSeek-V4's compressed entries, KVCacheSpec.entry_rules). An entry is made, by the step that computes its
    last token, from the last `span` tokens up to it (`ratio` when None; twice that for V4's overlapping
    compressors), which the window group still holds.
    """

    window: int | None = None
    sinks: int = 0
    ratio: int | None = None
    span: int | None = None

    @property
    def source_span(self) -> int | None:
        """Tokens each entry of a pooled group is made from (None for a layer's own group)."""
        return self.span or self.ratio

    @property
    def source_rule(self) -> "AttentionRule":
        """The layers' own group (window, sinks) whose rows a pooled group's entries are made from."""
        return AttentionRule(self.window, self.sinks)


FULL = AttentionRule()


@dataclass(frozen=True)
class LayerCacheSpec:
    num_kv_heads: int  # 1 for the MLA latent
    head_dim: int  # kv_lora_rank + qk_rope_head_dim for MLA
    separate_value: bool  # GQA caches K and V; MLA reads its value out of the latent row
    value_dim: int | None = None  # V's head size when it differs from K's (MLA with mla_disable: 192 vs 128)
    window: int | None = None  # sliding-window attention over the last `window` tokens; None: full attention
    sinks: int = 0  # with a window: the sequence's first `sinks` tokens stay visible (attention sinks)
    # DeepSeek-V3.2: an indexer key of this width per token, kept in the same blocks as the latent row.
    index_head_dim: int | None = None
    # DeepSeek-V4: one compressed entry of this width per `entry_ratio` tokens, in the entry group of that ratio
    # (KVCacheSpec.entry_rules), stored apart from the layer's per-token rows.
    entry_dim: int = 0
    entry_ratio: int | None = None
    # Parts of a row (of an entry) that an 8-bit cache scales each on its own (kvcache/segments.py): DeepSeek-V4's
    # rows hold a kv and projections of very different ranges, each part with its own scale's tail.
    row_parts: int = 1
    entry_parts: int = 1

    def row_elements(self, dtype: torch.dtype) -> int:
        """Elements of one cached row per kv head: the values and, in 8-bit caches, a scale's tail per part."""
        return row_width(self.head_dim, dtype) + (self.row_parts - 1) * row_width(0, dtype)

    def entry_elements(self, dtype: torch.dtype) -> int:
        if not self.entry_dim:
            return 0
        return row_width(self.entry_dim, dtype) + (self.entry_parts - 1) * row_width(0, dtype)

    def entry_bytes(self, dtype: torch.dtype) -> int:
        return self.entry_elements(dtype) * dtype.itemsize

    def index_bytes_per_token(self, dtype: torch.dtype) -> int:
        return row_width(self.index_head_dim, dtype) * dtype.itemsize if self.index_head_dim else 0

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        if not self.separate_value:
            return self.num_kv_heads * self.row_elements(dtype) * dtype.itemsize + self.index_bytes_per_token(
                dtype
            )
        return self.num_kv_heads * (self.head_dim + (self.value_dim or self.head_dim)) * dtype.itemsize


@dataclass(frozen=True)
class KVCacheSpec:
    layers: tuple[LayerCacheSpec, ...]
    is_mla: bool
    # Elements per token per layer that per-head K/V would cache (MLA models only): heads x (qk_head + v_head).
    mha_elements_per_layer: int = 0
    # Groups of compressed entries the model makes itself (DeepSeek-V4), after the layers' own groups. Such a spec
    # has a block pool per group: a layer keeps its rows in a tensor of its own group's blocks and its entries in
    # one of its entry group's blocks, each page as wide as what its layers store.
    entry_rules: tuple[AttentionRule, ...] = ()
    # Whether its layers read 8-bit rows though not latent (DeepSeek-V4's parts, kvcache/segments.py).
    segmented_8bit: bool = False

    @property
    def takes_8bit(self) -> bool:
        """Whether kv_cache_dtype may name an 8-bit format: latent caches, or a model's own segmented rows."""
        return self.is_mla or self.segmented_8bit

    @property
    def pool_per_group(self) -> bool:
        return bool(self.entry_rules)

    def entry_group(self, layer: LayerCacheSpec) -> int | None:
        """The group of a layer's compressed entries (an index into group_rules()), None for a layer without."""
        if layer.entry_ratio is None:
            return None
        rule = next(r for r in self.entry_rules if r.ratio == layer.entry_ratio)
        return len(self.group_rules()) - len(self.entry_rules) + self.entry_rules.index(rule)

    def group_slot_bytes(self, dtype: torch.dtype) -> list[int]:
        """Bytes of one slot of each group, its layers together: a token's rows, or an entry group's entries."""
        out = self.group_bytes_per_token(dtype)
        for layer in self.layers:
            group = self.entry_group(layer)
            if group is not None:
                out[group] += layer.entry_bytes(dtype)
        return out

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes of one cache slot: a row of every layer (what a block costs, per token it holds)."""
        return sum(layer.bytes_per_token(dtype) for layer in self.layers)

    def context_bytes_per_token(self, dtype: torch.dtype) -> float:
        """What the cache grows by per token of a long sequence. With entry groups, each group's entries (of its own
        layers) per `ratio` tokens: the windows hold a fixed number of rows per request and grow by nothing.
        Otherwise a slot per token."""
        if not self.entry_rules:
            return self.bytes_per_token(dtype)
        sizes, first = self.group_slot_bytes(dtype), len(self.group_rules()) - len(self.entry_rules)
        return round(sum(sizes[first + i] / rule.ratio for i, rule in enumerate(self.entry_rules)), 2)

    def mha_bytes_per_token(self, dtype: torch.dtype) -> int:
        return len(self.layers) * self.mha_elements_per_layer * dtype.itemsize

    def group_rules(self) -> list[AttentionRule]:
        """One cache group per distinct attention rule, in the order layers first use them."""
        rules: list[AttentionRule] = []
        for layer in self.layers:
            rule = AttentionRule(layer.window, layer.sinks)
            if rule not in rules:
                rules.append(rule)
        return rules + list(self.entry_rules)

    def layer_groups(self) -> list[int]:
        """The cache group of each layer (an index into group_rules())."""
        rules = self.group_rules()
        return [rules.index(AttentionRule(layer.window, layer.sinks)) for layer in self.layers]

    def group_bytes_per_token(self, dtype: torch.dtype, index_only: bool = False) -> list[int]:
        """Bytes per token of each group's layers (index_only: of their indexer keys alone)."""
        out = [0] * len(self.group_rules())
        for layer, group in zip(self.layers, self.layer_groups(), strict=True):
            out[group] += layer.index_bytes_per_token(dtype) if index_only else layer.bytes_per_token(dtype)
        return out
