"""Multi-head Latent Attention over a paged latent cache.

Each token caches one row: the normed KV latent (kv_lora_rank) followed by the roped shared key
(qk_rope_head_dim). Decode absorbs W_UK into the query and applies W_UV after attention, so it attends over the
latent directly (MQA with one 576-wide head for DeepSeek-V2/V3). Prefill re-reads the whole context from the
same cache and expands per-head K/V, which costs less than absorbed attention when many queries share the
context; both paths read the cache, so chunked prefill and prefix-cache hits need nothing special.
"""

import math

import torch
from torch import nn

from mlaserve.attention.backend import AttentionBackend, write_to_cache
from mlaserve.attention.metadata import AttentionMetadata
from mlaserve.config.model_config import indexer_config
from mlaserve.config.quantization import BlockFP8Config
from mlaserve.kernels.registry import MLA_PREP, PER_HEAD, PREFILL_KV
from mlaserve.kvcache.quant import is_quantized, quantize_rows
from mlaserve.layers.attention import PagedAttention
from mlaserve.layers.indexer import Indexer
from mlaserve.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from mlaserve.layers.norm import RMSNorm
from mlaserve.layers.rotary import RotaryEmbedding, rope_frequencies
from mlaserve.parallel import ParallelContext


def per_head(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [T, H, K] @ w [H, N, K]^T for each head -> [T, H, N]: MLA's absorbed W_UK and W_UV. A decode step of a few
    tokens on CUDA takes kernels/skinny.py's GEMV kernel (one launch, weights loaded ahead); the einsum otherwise."""
    kernel = PER_HEAD.choose(x, w)
    if kernel is not None:
        return kernel(x, w)
    return torch.einsum("thk,hnk->thn", x, w)


# The latent norms' eps is fixed, whatever rms_norm_eps says: DeepSeek's code and transformers both leave it at
# the RMSNorm default (a config with another rms_norm_eps would otherwise differ from the reference).
LATENT_NORM_EPS = 1e-6


def yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def mla_softmax_scale(cfg: object) -> float:
    """1/sqrt(qk_head_dim), times mscale(all_dim)^2 under YaRN: the long-context temperature DeepSeek trains with."""
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    rope = getattr(cfg, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default" and rope.get("mscale_all_dim"):
        m = yarn_mscale(rope["factor"], rope["mscale_all_dim"])
        scale *= m * m
    return scale


class MLAAttention(nn.Module):
    def __init__(
        self,
        cfg: object,
        backend: AttentionBackend,
        ctx: ParallelContext,
        mla_disable: bool = False,
        quant: BlockFP8Config | None = None,
    ):
        super().__init__()
        self.backend = backend
        # mla_disable (vLLM's VLLM_MLA_DISABLE): cache expanded per-head K/V instead of the latent, so the
        # memory and speed MLA saves are measured on the same model rather than computed.
        self.mla_disable = mla_disable
        self.num_heads = ctx.shard(cfg.num_attention_heads, "num_attention_heads")
        self.kv_lora_rank, self.rope_dim = cfg.kv_lora_rank, cfg.qk_rope_head_dim
        self.nope_dim, self.v_dim = cfg.qk_nope_head_dim, cfg.v_head_dim
        qk_head = self.nope_dim + self.rope_dim
        bias = bool(getattr(cfg, "attention_bias", False))
        self.q_lora_rank = getattr(cfg, "q_lora_rank", None)
        q_width = self.q_lora_rank or cfg.num_attention_heads * qk_head
        self.kv_width = self.kv_lora_rank + self.rope_dim
        # The query's first projection and kv_a both read the hidden state: one GEMM (one weight stream at decode)
        # serves both where neither is split over ranks (V3's q_a_proj always, V2's q_proj without tensor
        # parallelism) and they share the bias setting (V2's q_proj has none).
        self.fused_qkv_a = bool(self.q_lora_rank or (ctx.tp_size == 1 and not bias))
        if self.fused_qkv_a:
            # ranks never split it: every rank computes the whole of both
            self.fused_qkv_a_proj = MergedColumnParallelLinear(
                cfg.hidden_size, [q_width, self.kv_width], bias, quant=quant
            )
        elif self.q_lora_rank:
            self.q_a_proj = ReplicatedLinear(cfg.hidden_size, self.q_lora_rank, bias, ctx, quant)
        else:
            self.q_proj = ColumnParallelLinear(cfg.hidden_size, q_width, False, ctx, quant)
        if not self.fused_qkv_a:
            self.kv_a_proj_with_mqa = ReplicatedLinear(cfg.hidden_size, self.kv_width, bias, ctx, quant)
        heads = cfg.num_attention_heads
        if self.q_lora_rank:
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, heads * qk_head, False, ctx, quant)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, LATENT_NORM_EPS)
        kv_b_width = heads * (self.nope_dim + self.v_dim)
        self.kv_b_proj = ColumnParallelLinear(self.kv_lora_rank, kv_b_width, False, ctx, quant)
        self.o_proj = RowParallelLinear(heads * self.v_dim, cfg.hidden_size, bias, ctx, quant)
        interleaved = getattr(cfg, "rope_interleave", True)  # DeepSeek-V2 always pairs adjacent features
        self.rotary = RotaryEmbedding(*rope_frequencies(cfg, self.rope_dim), interleaved=interleaved)
        self.scale = mla_softmax_scale(cfg)
        self.expanded = PagedAttention(backend, self.scale) if mla_disable else None
        index = indexer_config(cfg)
        if index is not None and mla_disable:
            raise ValueError(
                "mla_disable is not supported with DeepSeek-V3.2's indexer: sparse attention reads latent rows"
            )
        # DeepSeek-V3.2: the kv_cache passed in is then (latent rows, indexer keys) over the same blocks.
        self.indexer = Indexer(cfg, index, backend, ctx, quant) if index is not None else None
        self.w_uk: torch.Tensor | None = None
        self.w_uv: torch.Tensor | None = None
        self.dtype = torch.get_default_dtype()  # the model's: the absorbed weights' dtype, whatever kv_b's

    def process_weights_after_loading(self) -> None:
        # FP8 kv_b is dequantized once here: the absorbed products read it at the activations' dtype
        w = self.kv_b_proj.dequantized_weight(self.dtype)
        w = w.view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        # [H, R, nope]: folded into the decode query (stored transposed so that per_head reads rows of nope)
        self.w_uk = w[:, : self.nope_dim].transpose(1, 2).contiguous()
        self.w_uv = w[:, self.nope_dim :].contiguous()  # [H, v, R]: applied to the attended latent

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        q, kv = self.project_qkv_a(hidden)
        q_resid = None
        if self.q_lora_rank:
            q_resid = self.q_a_layernorm(q)
            q = self.q_b_proj(q_resid)
        q = q.view(num_tokens, self.num_heads, -1)
        if self.expanded is not None:
            latent, k_pe = kv.split([self.kv_lora_rank, self.rope_dim], dim=-1)
            q_pe, k_pe = self.rotary(positions, q[..., self.nope_dim :], k_pe.unsqueeze(1))
            out = self._expanded(
                q[..., : self.nope_dim], q_pe, self.kv_a_layernorm(latent), k_pe, kv_cache, meta
            )
            return self.o_proj(out.flatten(1))
        selected = None
        if self.indexer is not None:
            kv_cache, index_cache = kv_cache
            selected = self.indexer(positions, hidden, q_resid, index_cache, meta)
        self.rope_and_cache(positions, q, kv, kv_cache, meta.slot_mapping)
        if selected is not None:
            q_latent = per_head(q[..., : self.nope_dim], self.w_uk)
            out = self.backend.sparse_latent(
                q_latent, q[..., self.nope_dim :], kv_cache, selected, self.scale, self.kv_lora_rank
            )
            out = per_head(out, self.w_uv)
            return self.o_proj(out.reshape(num_tokens, self.num_heads * self.v_dim))

        nd, parts = meta.num_decodes, []
        if nd:
            parts.append(self._decode(q[:nd], kv_cache, meta))
        if nd < meta.num_seqs:
            parts.append(self._prefill(q[nd:], kv_cache, meta))
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.v_dim))

    def project_qkv_a(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(q_a_proj's output, or V2's q_proj's; kv_a_proj_with_mqa's): column views of one GEMM's output where the
        two are fused."""
        if self.fused_qkv_a:
            q, kv = self.fused_qkv_a_proj(hidden).split(self.fused_qkv_a_proj.local_sizes, dim=-1)
            return q, kv
        q = self.q_a_proj(hidden) if self.q_lora_rank else self.q_proj(hidden)
        return q, self.kv_a_proj_with_mqa(hidden)

    def rope_and_cache(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        kv: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Rotates q's rope part in place and writes each token's cache row (normed latent, roped shared key) at
        its slot. kv is the kv_a projection's output. On CUDA one kernel (kernels/mla_prep.py); this torch code is
        its CPU path and reference."""
        norm, rotary = self.kv_a_layernorm, self.rotary
        args = (positions, q, kv, norm.weight, norm.eps, rotary.inv_freq, rotary.scaling, rotary.interleaved,
                kv_cache, slot_mapping)  # fmt: skip
        kernel = MLA_PREP.choose(*args)
        if kernel is not None:
            kernel(*args)
            return
        latent, k_pe = kv.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        q_pe, k_pe = self.rotary(positions, q[..., self.nope_dim :], k_pe.unsqueeze(1))
        q[..., self.nope_dim :] = q_pe
        rows = torch.cat((self.kv_a_layernorm(latent).unsqueeze(1), k_pe), dim=-1)
        if is_quantized(kv_cache.dtype):
            rows = quantize_rows(rows, kv_cache.dtype)
        write_to_cache(kv_cache, slot_mapping, rows)

    def _expanded(self, q_nope, q_pe, latent, k_pe, kv_cache, meta) -> torch.Tensor:
        """Per-head K/V for the new tokens, cached and attended like GQA with as many KV heads as query heads."""
        kv = self.kv_b_proj(latent).view(latent.shape[0], self.num_heads, self.nope_dim + self.v_dim)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        k = torch.cat((k_nope, k_pe.expand(-1, self.num_heads, -1)), dim=-1)
        return self.expanded(torch.cat((q_nope, q_pe), dim=-1), k, v.contiguous(), kv_cache, meta)

    def _decode(self, q, kv_cache, meta) -> torch.Tensor:
        q_latent = per_head(q[..., : self.nope_dim], self.w_uk)
        out_latent = self.backend.decode_latent(
            q_latent, q[..., self.nope_dim :], kv_cache, meta, self.scale, self.kv_lora_rank
        )
        return per_head(out_latent, self.w_uv)

    def _prefill(self, q, kv_cache, meta) -> torch.Tensor:
        """q: the prefill tokens' queries, rope part already rotated (rope_and_cache)."""
        context = self.backend.gather_prefill_context(kv_cache, meta, q.dtype)[:, 0]  # [S, R + P]
        latent, k_pe = context.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv = self.kv_b_proj(latent).view(context.shape[0], self.num_heads, self.nope_dim + self.v_dim)
        pad = self.backend.prefill_pads_values(q, self.num_heads, self.v_dim, meta)
        kernel = PREFILL_KV.choose(kv, k_pe, self.nope_dim, pad)
        if kernel is not None:
            # K and V in one pass, V zero-padded to K's width where the backend's prefill takes one head size
            k, v = kernel(kv, k_pe, self.nope_dim, pad)
            return self.backend.prefill(q, k, v, meta, self.scale)[..., : self.v_dim]
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        k = torch.cat((k_nope, k_pe.unsqueeze(1).expand(-1, self.num_heads, -1)), dim=-1)
        return self.backend.prefill(q, k, v, meta, self.scale)
