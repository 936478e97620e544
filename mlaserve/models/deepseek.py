"""DeepSeek-V2 / V3: MLA attention on a latent cache, MoE with shared experts after the first dense layers."""

import re

import torch
from torch import nn

from mlaserve.attention.metadata import AttentionMetadata
from mlaserve.config.quantization import BlockFP8Config
from mlaserve.kvcache.spec import KVCacheSpec, LayerCacheSpec
from mlaserve.layers.embedding import VocabParallelEmbedding
from mlaserve.layers.linear import ReplicatedLinear
from mlaserve.layers.mla import MLAAttention
from mlaserve.layers.moe import FusedExperts, MoEGate
from mlaserve.layers.norm import RMSNorm
from mlaserve.models.base import CausalLM, DecoderStack, ModelInit, PreNormDecoderLayer, StackedParam
from mlaserve.models.llama import GatedMLP
from mlaserve.parallel import ParallelContext

# a weight, or (block-FP8 checkpoints) its scales
_EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|weight_scale_inv)$")
_SHARED = re.compile(r"\.mlp\.shared_experts\.(gate_proj|up_proj|down_proj)\.(weight|weight_scale_inv)$")
_EXPERT_PARAMS = {"weight": ("w13", "w2"), "weight_scale_inv": ("w13_scale", "w2_scale")}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


class DeepseekMoE(nn.Module):
    @staticmethod
    def fuses_shared_experts(cfg: object, ctx: ParallelContext, quant: BlockFP8Config | None) -> bool:
        """The shared experts run in the routed experts' grouped GEMM (layers/moe.py), except under expert
        parallelism, where each rank holds only its own experts and the shared MLP stays whole on every rank,
        and where a checkpoint's FP8 scale blocks of the shared MLP span two of its experts' widths."""
        if quant is not None and quant.from_checkpoint and (cfg.n_shared_experts or 0) > 1:
            if cfg.moe_intermediate_size % quant.block_k:
                return False
        return not ctx.expert_parallel

    def __init__(
        self, cfg: object, ctx: ParallelContext, sigmoid: bool, quant: BlockFP8Config | None
    ) -> None:
        super().__init__()
        shared = cfg.n_shared_experts or 0
        fused = shared if self.fuses_shared_experts(cfg, ctx, quant) else 0
        self.gate = MoEGate(cfg, sigmoid, num_shared=fused)
        self.experts = FusedExperts(
            cfg.n_routed_experts,
            cfg.hidden_size,
            cfg.moe_intermediate_size,
            cfg.hidden_act,
            ctx,
            fused,
            quant,
        )
        self.shared_experts = (
            GatedMLP(cfg.hidden_size, cfg.moe_intermediate_size * shared, cfg.hidden_act, ctx, quant=quant)
            if shared and not fused
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        shared = None if self.shared_experts is None else self.shared_experts(x)
        return self.experts(x, weights, ids, add=shared)


class DeepseekDecoderLayer(PreNormDecoderLayer):
    def __init__(self, init: ModelInit, idx: int, sigmoid: bool):
        super().__init__()
        cfg, ctx, quant = init.hf_config, init.ctx, init.quant
        self.self_attn = MLAAttention(cfg, init.backend, ctx, init.mla_disable, quant)
        types = getattr(cfg, "mlp_layer_types", None)  # V3.2 configs name each layer's MLP
        if types is not None and idx < len(types):  # (multi-token-prediction layers come after them: MoE)
            dense = types[idx] == "dense" or not cfg.n_routed_experts
        else:
            dense = idx < (getattr(cfg, "first_k_dense_replace", 0) or 0) or not cfg.n_routed_experts
        self.mlp = (
            GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, ctx, quant=quant)
            if dense
            else DeepseekMoE(cfg, ctx, sigmoid, quant)
        )
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DeepseekMTP(nn.Module):
    """A multi-token-prediction module of DeepSeek-V3's checkpoints (checkpoint layer num_hidden_layers + k): the
    next token's embedding and the main model's last hidden state, each normed, joined by eh_proj, then one decoder
    layer and its own final norm before the shared LM head. Speculative decoding runs it as the draft model
    (runner/mtp_draft.py). Its embedding and head are the main model's (the checkpoint's copies are not read)."""

    def __init__(self, init: ModelInit, idx: int, sigmoid: bool) -> None:
        super().__init__()
        cfg = init.hf_config
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.eh_proj = ReplicatedLinear(
            2 * cfg.hidden_size, cfg.hidden_size, False, init.ctx
        )  # bf16 in DeepSeek's
        self.block = DeepseekDecoderLayer(init, idx, sigmoid)
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        embedded: torch.Tensor,
        positions: torch.Tensor,
        previous: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Per row, the hidden state (before shared_head.norm) at a position, from the embedding of the token after
        it and the hidden state there before any final norm: the main model's, or this layer's own output for a
        later draft."""
        joined = torch.cat((self.enorm(embedded), self.hnorm(previous)), dim=-1)
        hidden, residual = self.block(positions, self.eh_proj(joined), None, kv_cache, meta)
        return hidden + residual


class DeepseekModel(DecoderStack):
    def __init__(self, init: ModelInit, sigmoid: bool) -> None:
        super().__init__()
        cfg = init.hf_config
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, init.ctx)
        self.layers = nn.ModuleList(
            DeepseekDecoderLayer(init, i, sigmoid) for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DeepseekV2ForCausalLM(CausalLM):
    sigmoid_routing = False  # V2 routes with softmax scores
    stacked_params = (
        StackedParam(".gate_up_proj.", ".gate_proj.", 0),
        StackedParam(".gate_up_proj.", ".up_proj.", 1),
    )

    supports_mla_disable = True
    supports_tensor_parallel = True
    supports_block_fp8 = True

    @classmethod
    def latent_cache(cls, mla_disable: bool, enable_mla: bool = False) -> bool:
        return not mla_disable

    def __init__(self, init: ModelInit) -> None:
        super().__init__()
        cfg, ctx = init.hf_config, init.ctx
        self.cfg = cfg
        self.mla_disable = init.mla_disable
        self.shared_experts_fused = DeepseekMoE.fuses_shared_experts(cfg, ctx, init.quant)
        self.model = DeepseekModel(init, self.sigmoid_routing)
        self.build_lm_head(cfg, ctx)
        layers = cfg.num_hidden_layers
        self.mtp = nn.ModuleList(
            DeepseekMTP(init, layers + k, self.sigmoid_routing) for k in range(init.mtp_layers)
        )

    def mtp_forward(
        self,
        k: int,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        previous: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Multi-token-prediction module k over a batch: its hidden states before its head's norm. Its cache is
        the layer after the main model's (kv_cache_spec)."""
        embedded = self.model.embed_tokens(input_ids)
        cache = kv_caches[self.cfg.num_hidden_layers + k]
        return self.mtp[k](embedded, positions, previous, cache, meta)

    def mtp_logits(self, k: int, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(self.mtp[k].shared_head.norm(hidden))

    def cached_layers(self) -> list[nn.Module]:
        return [*self.model.layers, *(m.block for m in self.mtp)]

    def latent_attention_shape(self) -> tuple[int, int, int] | None:
        if self.mla_disable:
            return None
        return self.model.layers[0].self_attn.num_heads, self.cfg.kv_lora_rank, self.cfg.qk_rope_head_dim

    def prefill_attention_shape(self) -> tuple[int, int, int, int] | None:
        heads, cfg = self.model.layers[0].self_attn.num_heads, self.cfg
        return heads, heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim

    def kv_cache_spec(self) -> KVCacheSpec:
        cfg = self.cfg
        # this rank's heads: every rank caches the whole latent row, but per-head K/V only for its own heads
        heads = self.model.layers[0].self_attn.num_heads
        per_head = heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim)
        if self.mla_disable:
            expanded = LayerCacheSpec(
                heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, True, cfg.v_head_dim
            )
            return KVCacheSpec(tuple(expanded for _ in range(self.num_cached_layers)), False)
        index = getattr(cfg, "index_head_dim", None) if getattr(cfg, "index_topk", None) else None
        latent = LayerCacheSpec(1, cfg.kv_lora_rank + cfg.qk_rope_head_dim, False, index_head_dim=index)
        return KVCacheSpec(tuple(latent for _ in range(self.num_cached_layers)), True, per_head)

    @property
    def num_cached_layers(self) -> int:
        """The decoder layers, then any multi-token-prediction layers: each caches as a decoder layer does, in
        the same blocks (a draft layer's rows follow the sequence's)."""
        return self.cfg.num_hidden_layers + len(self.mtp)

    def map_checkpoint_name(self, name: str) -> tuple[str, object] | None:
        layer = _LAYER.match(name)
        if layer and int(layer.group(1)) >= self.cfg.num_hidden_layers:
            name = self._mtp_name(int(layer.group(1)) - self.cfg.num_hidden_layers, name[layer.end() :])
            if name is None:
                return None
        expert = _EXPERT.search(name)
        if expert:
            idx, proj = int(expert.group(1)), expert.group(2)
            w13, w2 = _EXPERT_PARAMS[expert.group(3)]
            prefix = name[: expert.start()] + ".mlp.experts."
            if proj == "down_proj":
                return prefix + w2, idx
            return prefix + w13, (idx, 0 if proj == "gate_proj" else 1)
        shared = _SHARED.search(name) if self.shared_experts_fused else None
        if shared:
            prefix = name[: shared.start()] + ".mlp.experts."
            proj = shared.group(1)
            w13, w2 = _EXPERT_PARAMS[shared.group(2)]
            if proj == "down_proj":
                return prefix + w2, "shared"
            return prefix + w13, ("shared", int(proj == "up_proj"))
        if self.model.layers[0].self_attn.fused_qkv_a:  # MLAAttention: q's first projection and kv_a in one
            for fragment, shard in ((".self_attn.q_a_proj.", 0), (".self_attn.q_proj.", 0),
                                    (".self_attn.kv_a_proj_with_mqa.", 1)):  # fmt: skip
                if fragment in name:
                    return name.replace(fragment, ".self_attn.fused_qkv_a_proj."), shard
        return super().map_checkpoint_name(name)

    def _mtp_name(self, k: int, rest: str) -> str | None:
        """The parameter a multi-token-prediction layer's tensor loads into; None where it is not read (modules
        not built, or the copies of the embedding and the LM head they share)."""
        if k >= len(self.mtp) or rest.startswith(("embed_tokens.", "shared_head.head.")):
            return None
        own = rest.startswith(("enorm.", "hnorm.", "eh_proj.", "shared_head."))
        return f"mtp.{k}." + ("" if own else "block.") + rest

    def process_weights_after_loading(self) -> None:
        for layer in self.cached_layers():
            layer.self_attn.process_weights_after_loading()


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    sigmoid_routing = True
    supports_mtp = True  # its checkpoints carry num_nextn_predict_layers multi-token-prediction layers


class DeepseekV32ForCausalLM(DeepseekV3ForCausalLM):
    """V3 with the lightning indexer in every attention layer (layers/indexer.py): sparse top-k attention. Under
    tensor parallelism the attention heads split as V3's and every rank holds the whole indexer, so every rank
    caches the same indexer keys and selects the same slots for its own heads (no collective of its own)."""

    # Decode graphs select over max_model_len keys (the captured metadata's length) and always take the top-k
    # (-1 padded), so a captured step does not depend on the step's lengths. A prefill graph's metadata is its
    # padded size, from which the indexer would pick dense or sparse attention for the real prompts: not captured.
    supports_prefill_graphs = False

    @property
    def index_topk(self) -> int:
        return self.cfg.index_topk
