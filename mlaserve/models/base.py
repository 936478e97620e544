"""What every model offers the engine, and the checkpoint-name mapping they share."""

from dataclasses import dataclass

import torch
from torch import nn

from mlaserve.attention.backend import AttentionBackend
from mlaserve.attention.metadata import AttentionMetadata
from mlaserve.attention.pooled_window import PooledWindow
from mlaserve.config.quantization import BlockFP8Config
from mlaserve.kvcache.spec import KVCacheSpec
from mlaserve.parallel import SINGLE, ParallelContext


@dataclass(frozen=True)
class ModelInit:
    """What every model is built from, so the executor builds any architecture with one call: cls(init).
    A model reads the options it supports; the executor refuses the others before building (supports_* flags)."""

    hf_config: object
    backend: AttentionBackend  # what its attention layers call (a model that attends itself ignores it)
    ctx: ParallelContext = SINGLE  # this rank's slice of every weight
    mla_disable: bool = False  # MLA models: cache expanded per-head K/V instead of latent rows
    enable_mla: bool = False  # per-head K/V models: convert to a latent cache at load time
    mla_skip_layers: tuple[int, ...] = ()  # with enable_mla: layers that keep their per-head K/V cache
    quant: BlockFP8Config | None = None  # the layers' weight format (None: the model's dtype)
    mtp_layers: int = 0  # multi-token-prediction modules to build and load (models that have them)


@dataclass(frozen=True)
class StackedParam:
    """A checkpoint tensor name fragment that loads into a slice of a fused parameter."""

    param_fragment: str  # e.g. ".qkv_proj."
    ckpt_fragment: str  # e.g. ".q_proj."
    shard_id: object


class CausalLM(nn.Module):
    supports_mla_disable = False  # MLA models can cache expanded per-head K/V instead (mla_disable)
    # False where a layer's step has host-dependent shapes (capture would be wrong)
    supports_cuda_graphs = True
    # True where the layers attend without the attention backend (their own torch code): then supports_cuda_graphs
    # alone decides capture, whatever the backend, cache layout or groups
    attends_itself = False
    # False where a prefill graph's padded metadata would change the step's work
    supports_prefill_graphs = True
    # whether the engine's training-free sliding_window / num_sink_tokens options apply to its cache
    training_free_window = True
    # whether its layers split over tensor-parallel ranks (checked against transformers at size 2 on CPU)
    supports_tensor_parallel = False
    # whether its linear layers and experts take block-FP8 weights (ModelInit.quant)
    supports_block_fp8 = False
    # whether its own (not latent) cache rows take an 8-bit kv_cache_dtype (kvcache/segments.py)
    segmented_8bit_cache = False
    # whether its routed experts take MXFP4 weights (a block-FP8 checkpoint with expert_dtype "fp4")
    supports_mxfp4_experts = False
    # whether its checkpoints' multi-token-prediction layers can serve as the draft model (speculative "mtp")
    supports_mtp = False
    stacked_params: tuple[StackedParam, ...] = ()
    # Checkpoint names containing any of these are not weights (rotary caches, multi-token-prediction heads).
    ignored_fragments: tuple[str, ...] = ("rotary_emb.inv_freq",)

    def build_lm_head(self, cfg: object, ctx: ParallelContext) -> None:
        """The LM head, tied to the input embedding where the config says so (the checkpoint's copy is then not a
        weight); after self.model is built."""
        from mlaserve.layers.embedding import ParallelLMHead

        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, ctx)
        if getattr(cfg, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight
            self.ignored_fragments = (*self.ignored_fragments, "lm_head.weight")

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        return self.model(input_ids, positions, kv_caches, meta)

    def forward_with_prenorm(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(forward's hidden states, the same before the final norm), for a draft layer that reads the latter."""
        return self.model.forward_with_prenorm(input_ids, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)

    def kv_cache_spec(self) -> KVCacheSpec:
        raise NotImplementedError

    supports_enable_mla = False  # enable_mla: per-head K/V models served from a latent cache

    @classmethod
    def latent_cache(cls, mla_disable: bool, enable_mla: bool = False) -> bool:
        """Whether the model caches MLA latent rows (known before it is built: options are checked against it)."""
        return False

    def latent_attention_shape(self) -> tuple[int, int, int] | None:
        """(query heads per rank, kv_lora_rank, qk_rope_head_dim) of absorbed MLA decode over a latent cache, which
        picks the decode kernel; None where the cache holds per-head K/V."""
        return None

    def prefill_attention_shape(self) -> tuple[int, int, int, int] | None:
        """(query heads per rank, K/V heads, query/key width, value width) of the prefill attention the backend
        runs, which picks the prefill kernel; None where the model says nothing (or attends itself)."""
        return None

    def map_checkpoint_name(self, name: str) -> tuple[str, object] | None:
        """(parameter name, shard id) for a checkpoint tensor, or None if it is not a weight we use."""
        if any(fragment in name for fragment in self.ignored_fragments):
            return None
        for stacked in self.stacked_params:
            if stacked.ckpt_fragment in name:
                return name.replace(stacked.ckpt_fragment, stacked.param_fragment), stacked.shard_id
        return name, None

    def set_cache_groups(self, layer_groups: list[int]) -> None:
        """Tell each layer's attention which cache group (block tables, window) it reads (KVCacheSpec.layer_groups)."""
        for layer, group in zip(self.cached_layers(), layer_groups, strict=True):
            for module in layer.modules():
                if hasattr(module, "cache_group"):
                    module.cache_group = group

    def cached_layers(self) -> list[nn.Module]:
        """The layers with a cache of their own, in the order of kv_cache_spec's layers."""
        return list(self.model.layers)

    def set_block_topk(self, topk: int) -> None:
        """The engine's training-free index_topk, on every paged attention layer (per-head K/V caches)."""
        from mlaserve.layers.attention import PagedAttention

        for module in self.modules():
            if isinstance(module, PagedAttention):
                module.block_topk = topk

    def set_pooled_window(self, rule: PooledWindow, group: int, pooled_group: int) -> None:
        """The engine's training-free compress_ratio, on every paged attention layer of cache group `group` (the
        model's full-attention layers, now windowed; per-head K/V caches), whose pooled entries are group
        `pooled_group`'s."""
        from mlaserve.layers.attention import PagedAttention

        for module in self.modules():
            if isinstance(module, PagedAttention) and module.cache_group == group:
                module.pooled_window, module.pooled_group = rule, pooled_group

    def process_weights_after_loading(self) -> None:
        """Derived tensors (absorbed MLA weights, fused experts) are built here, once."""


class PreNormDecoderLayer(nn.Module):
    """The residual pattern every model here shares; subclasses build self_attn, mlp and the two norms.

    The residual stream is carried beside the layer's output rather than added at its end: each residual add then
    happens inside the next norm's call (one kernel on CUDA, the add then the norm elsewhere), the last one in the
    final norm. forward returns (mlp output, residual stream before adding it)."""

    def forward(
        self, positions, hidden, residual: torch.Tensor | None, kv_cache, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:  # the first layer: hidden is the embedding itself
            normed, residual = self.input_layernorm(hidden), hidden
        else:
            normed, residual = self.input_layernorm.forward_with_residual(hidden, residual)
        attn_out = self.self_attn(positions, normed, kv_cache, meta)
        normed, residual = self.post_attention_layernorm.forward_with_residual(attn_out, residual)
        return self.mlp(normed), residual


class DecoderStack(nn.Module):
    """Embedding, the layers (each with its own cache), final norm; subclasses build the three."""

    def forward(self, input_ids, positions, kv_caches, meta: AttentionMetadata) -> torch.Tensor:
        return self.forward_with_prenorm(input_ids, positions, kv_caches, meta)[0]

    def forward_with_prenorm(
        self, input_ids, positions, kv_caches, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the final norm's output, its input: the residual stream after the last layer)."""
        hidden, residual = self.embed_tokens(input_ids), None
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden, residual = layer(positions, hidden, residual, kv_cache, meta)
        if residual is None:  # no layers
            return self.norm(hidden), hidden
        return self.norm.forward_with_residual(hidden, residual)
