"""Llama-family decoder (Llama, Qwen2 with its qkv bias, Mistral, SmolLM2): GQA over a paged K/V cache."""

import logging
from collections.abc import Sequence

import torch
from torch import nn

from mlaserve.attention.backend import AttentionBackend
from mlaserve.attention.metadata import AttentionMetadata
from mlaserve.config.model_config import layer_windows
from mlaserve.config.quantization import BlockFP8Config
from mlaserve.kvcache.spec import KVCacheSpec, LayerCacheSpec
from mlaserve.layers.activation import gated_act
from mlaserve.layers.attention import PagedAttention
from mlaserve.layers.embedding import VocabParallelEmbedding
from mlaserve.layers.latent_gqa import LatentGQA
from mlaserve.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from mlaserve.layers.norm import RMSNorm
from mlaserve.layers.rotary import RotaryEmbedding, rope_frequencies
from mlaserve.models.base import CausalLM, DecoderStack, ModelInit, PreNormDecoderLayer, StackedParam
from mlaserve.parallel import ParallelContext

logger = logging.getLogger(__name__)


def head_dim_of(cfg: object) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


class GatedMLP(nn.Module):
    def __init__(
        self,
        hidden: int,
        intermediate: int,
        act: str,
        ctx: ParallelContext,
        bias: bool = False,
        quant: BlockFP8Config | None = None,
    ):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [intermediate, intermediate], bias, ctx, quant)
        self.down_proj = RowParallelLinear(intermediate, hidden, bias, ctx, quant)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gated_act(self.gate_up_proj(x), self.act))


class LlamaAttention(nn.Module):
    def __init__(
        self,
        cfg: object,
        backend: AttentionBackend,
        ctx: ParallelContext,
        biases: tuple[bool, bool],
        enable_mla: bool = False,
        quant: BlockFP8Config | None = None,
    ):
        super().__init__()
        qkv_bias, o_bias = biases
        self.head_dim = head_dim_of(cfg)
        heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size, self.head_dim, heads, kv_heads, qkv_bias, ctx, quant
        )
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(heads * self.head_dim, cfg.hidden_size, o_bias, ctx, quant)
        rotary_dim = int(self.head_dim * getattr(cfg, "partial_rotary_factor", 1.0))
        self.rotary = RotaryEmbedding(*rope_frequencies(cfg, rotary_dim), interleaved=False)
        scale = self.head_dim**-0.5
        self.enable_mla = enable_mla
        self.attn = (
            LatentGQA(backend, scale, self.num_heads, self.num_kv_heads, self.head_dim, self.rotary)
            if enable_mla
            else PagedAttention(backend, scale)
        )

    def forward(self, positions, hidden, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        qkv = self.qkv_proj(hidden)
        if self.enable_mla:  # the latent layer rotates the features it keeps rotated itself
            q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
            out = self.attn(
                positions,
                q.view(-1, self.num_heads, self.head_dim),
                k.view(-1, self.num_kv_heads, self.head_dim),
                v.view(-1, self.num_kv_heads, self.head_dim),
                kv_cache,
                meta,
            )
            return self.o_proj(out.reshape(out.shape[0], -1))
        # q and k sit side by side in the fused output: one rotation over their heads costs half of two
        qk = qkv[:, : q_size + kv_size].view(-1, self.num_heads + self.num_kv_heads, self.head_dim)
        qk = self.rotary.rotate_heads(positions, qk)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, q_size + kv_size :].view(-1, self.num_kv_heads, self.head_dim)
        out = self.attn(q, k, v, kv_cache, meta)
        return self.o_proj(out.reshape(out.shape[0], -1))


class LlamaDecoderLayer(PreNormDecoderLayer):
    def __init__(self, init: ModelInit, biases: tuple[bool, bool], enable_mla: bool):
        super().__init__()
        cfg, ctx, quant = init.hf_config, init.ctx, init.quant
        self.self_attn = LlamaAttention(cfg, init.backend, ctx, biases, enable_mla, quant)
        mlp_bias = getattr(cfg, "mlp_bias", False)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, ctx, mlp_bias, quant)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaModel(DecoderStack):
    def __init__(self, init: ModelInit, biases: tuple[bool, bool], latent: Sequence[bool]):
        """latent[i]: layer i serves its attention from an MLA latent cache (enable_mla), else per-head K/V."""
        super().__init__()
        cfg = init.hf_config
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, init.ctx)
        self.layers = nn.ModuleList(LlamaDecoderLayer(init, biases, flag) for flag in latent)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(CausalLM):
    stacked_params = (
        StackedParam(".qkv_proj.", ".q_proj.", "q"),
        StackedParam(".qkv_proj.", ".k_proj.", "k"),
        StackedParam(".qkv_proj.", ".v_proj.", "v"),
        StackedParam(".gate_up_proj.", ".gate_proj.", 0),
        StackedParam(".gate_up_proj.", ".up_proj.", 1),
    )

    supports_enable_mla = True  # exact GQA -> MLA conversion at load time (layers/latent_gqa.py)
    supports_tensor_parallel = True
    supports_block_fp8 = True

    def __init__(self, init: ModelInit) -> None:
        """Layers in init.mla_skip_layers keep their per-head K/V cache: a second kind of cache row in the same
        blocks."""
        super().__init__()
        cfg = self.cfg = init.hf_config
        self.enable_mla = init.enable_mla
        skipped = set(init.mla_skip_layers)
        latent = [init.enable_mla and i not in skipped for i in range(cfg.num_hidden_layers)]
        self.model = LlamaModel(init, self.biases(cfg), latent)
        self.build_lm_head(cfg, init.ctx)

    @staticmethod
    def biases(cfg: object) -> tuple[bool, bool]:
        """(qkv bias, o_proj bias): Llama's attention_bias covers both."""
        bias = bool(getattr(cfg, "attention_bias", False))
        return bias, bias

    @classmethod
    def latent_cache(cls, mla_disable: bool, enable_mla: bool = False) -> bool:
        return enable_mla

    def latent_attention_shape(self) -> tuple[int, int, int] | None:
        attn = next((layer.self_attn.attn for layer in self.model.layers if layer.self_attn.enable_mla), None)
        return None if attn is None else (attn.num_heads, attn.latent_dim, attn.rope_dim)

    def prefill_attention_shape(self) -> tuple[int, int, int, int] | None:
        attn = self.model.layers[0].self_attn
        if self.enable_mla:  # latent layers attend through layers/latent_gqa.py
            return None
        return attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.head_dim

    def kv_cache_spec(self) -> KVCacheSpec:
        attn = self.model.layers[0].self_attn
        layers = []
        for layer, window in zip(self.model.layers, layer_windows(self.cfg), strict=True):
            a = layer.self_attn
            if a.enable_mla:  # one row per token: the latent, then the rope key (layers/latent_gqa.py)
                layers.append(LayerCacheSpec(1, a.attn.latent_dim + a.attn.rope_dim, False, window=window))
            else:
                layers.append(LayerCacheSpec(a.num_kv_heads, a.head_dim, separate_value=True, window=window))
        # is_mla: every layer latent (the MLA kernels, CUDA graphs and 8-bit caches apply); with skipped layers
        # the per-head comparison is still reported.
        return KVCacheSpec(
            tuple(layers),
            is_mla=self.enable_mla and all(layer.self_attn.enable_mla for layer in self.model.layers),
            mha_elements_per_layer=2 * attn.num_kv_heads * attn.head_dim if self.enable_mla else 0,
        )


class Qwen2ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def biases(cfg: object) -> tuple[bool, bool]:
        return True, False


class MistralForCausalLM(LlamaForCausalLM):
    pass
