"""What every model offers the engine, and the checkpoint-name mapping they share."""

from dataclasses import dataclass

import torch
from torch import nn

from mlaserve.attention.metadata import AttentionMetadata
from mlaserve.kvcache.spec import KVCacheSpec


@dataclass(frozen=True)
class StackedParam:
    """A checkpoint tensor name fragment that loads into a slice of a fused parameter."""

    param_fragment: str  # e.g. ".qkv_proj."
    ckpt_fragment: str  # e.g. ".q_proj."
    shard_id: object


class CausalLM(nn.Module):
    supports_mla_disable = False  # MLA models can cache expanded per-head K/V instead (mla_disable)
    stacked_params: tuple[StackedParam, ...] = ()
    # Checkpoint names containing any of these are not weights (rotary caches, multi-token-prediction heads).
    ignored_fragments: tuple[str, ...] = ("rotary_emb.inv_freq",)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        raise NotImplementedError

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def kv_cache_spec(self) -> KVCacheSpec:
        raise NotImplementedError

    def map_checkpoint_name(self, name: str) -> tuple[str, object] | None:
        """(parameter name, shard id) for a checkpoint tensor, or None if it is not a weight we use."""
        if any(fragment in name for fragment in self.ignored_fragments):
            return None
        for stacked in self.stacked_params:
            if stacked.ckpt_fragment in name:
                return name.replace(stacked.ckpt_fragment, stacked.param_fragment), stacked.shard_id
        return name, None

    def process_weights_after_loading(self) -> None:
        """Derived tensors (absorbed MLA weights, fused experts) are built here, once."""


class PreNormDecoderLayer(nn.Module):
    """The residual pattern every model here shares; subclasses build self_attn, mlp and the two norms."""

    def forward(self, positions, hidden, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        attn_out = self.self_attn(positions, self.input_layernorm(hidden), kv_cache, meta)
        # The residual add and the second norm are one kernel on CUDA; elsewhere the same add, then the norm.
        normed, hidden = self.post_attention_layernorm.forward_with_residual(attn_out, hidden)
        return hidden + self.mlp(normed)


class DecoderStack(nn.Module):
    """Embedding, the layers (each with its own cache), final norm; subclasses build the three."""

    def forward(self, input_ids, positions, kv_caches, meta: AttentionMetadata) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden = layer(positions, hidden, kv_cache, meta)
        return self.norm(hidden)
