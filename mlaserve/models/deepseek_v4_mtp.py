"""DeepSeek-V4's multi-token-prediction (MTP) layer, run as the speculative method "mtp"'s draft model.

V4 checkpoints declare num_nextn_predict_layers and ship each layer k under `mtp.{k}.*` in DeepSeek's names
(transformers' DeepseekV4 ignores them on load): a whole decoder block (attn.*, ffn.*, attn_norm, ffn_norm and its
hyper-connections hc_attn_* / hc_ffn_*) and its own parts: enorm, hnorm, e_proj, h_proj, norm and a stream collapse
hc_head_fn / hc_head_base / hc_head_scale. Its embedding and LM head are the main model's.

The layer reads the main model's hyper-connection streams after its last block, uncollapsed ([T, hc_mult, hidden]):
    x = e_proj(enorm(embed(next token)))[:, None] + h_proj(hnorm(streams))      (hnorm over each stream)
    streams' = block(x)                                                         (attention, MoE, hyper-connections)
    logits = head(norm(hc_head(streams')))                                      (its own collapse and norm)
Its block is DeepSeek's block number num_hidden_layers + k, whose attention kind is compress_ratios[that index] in
DeepSeek's config (0 in V4-Flash's: the sliding window alone, no compressor) and whose MoE is score-routed (past
the hash-routed first layers). So its rows join the window group's blocks like every layer's, and it makes no
compressed entries. Chained drafts (k > 1) take the layer's own output streams in place of the main model's, as
runner/mtp_draft.py chains DeepSeek-V3's layer.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from mlaserve.attention.metadata import AttentionMetadata
from mlaserve.config.quantization import BlockFP8Config
from mlaserve.layers.hyper_connection import HyperHead
from mlaserve.layers.norm import Float32RMSNorm
from mlaserve.models.deepseek_v4_ffn import v4_linear

# DeepSeek's names of an MTP layer's own parts; everything else under mtp.{k}. is its block's
_OWN = ("e_proj.", "h_proj.", "enorm.", "hnorm.", "norm.")
_NAME = re.compile(r"^(?:model\.)?mtp\.(\d+)\.(.*)$")
SLIDING_KIND, SCORE_ROUTED = "sliding_attention", "moe"


def mtp_block_kinds(cfg: object, k: int) -> tuple[str, str]:
    """(attention kind, MoE kind) of MTP layer k's block. A config that gives the block a compression ratio
    (DeepSeek's compress_ratios, one entry per block and MTP layer; config/model_config.py keeps the MTP layers'
    as mtp_compress_ratios) asks for compressed entries this layer does not make: refused, naming it."""
    ratios = getattr(cfg, "mtp_compress_ratios", None)
    if ratios is None:  # a config read as config.json spells it (no transformers class) keeps the whole list
        ratios = (getattr(cfg, "compress_ratios", None) or [])[cfg.num_hidden_layers :]
    index = cfg.num_hidden_layers + k
    ratio = ratios[k] if k < len(ratios) else 0
    if ratio:
        raise ValueError(
            f"speculative_config method 'mtp': config.json compress_ratios[{index}]={ratio} gives DeepSeek-V4's MTP "
            "layer compressed attention; only its sliding-window attention (ratio 0, as V4-Flash ships) is built"
        )
    return SLIDING_KIND, SCORE_ROUTED


def mtp_param_name(name: str, num_built: int) -> str | None:
    """The parameter a checkpoint's `mtp.{k}.*` tensor loads into (mtp.{k}.block.* for its block's), None for a
    layer not built; a name outside mtp.* unchanged."""
    match = _NAME.match(name)
    if match is None:
        return name
    k, rest = int(match[1]), match[2]
    if k >= num_built or rest.startswith(("embed.", "head.", "emb.")):  # not built, or copies of shared parts
        return None
    if rest.startswith(("block.", "hc_head.")):  # the model's own names, as its state_dict saves them
        return f"mtp.{k}.{rest}"
    if rest.startswith("hc_head_"):
        return f"mtp.{k}.hc_head.hc_{rest.removeprefix('hc_head_')}"
    return f"mtp.{k}." + ("" if rest.startswith(_OWN) else "block.") + rest


class V4MTP(nn.Module):
    def __init__(self, cfg: object, block: nn.Module, quant: BlockFP8Config | None = None) -> None:
        """block: the decoder block (models/deepseek_v4.V4DecoderLayer) of mtp_block_kinds."""
        super().__init__()
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.enorm, self.hnorm, self.norm = (Float32RMSNorm(hidden, eps) for _ in range(3))
        # block FP8 in DeepSeek's checkpoint, replicated over tensor-parallel ranks (every rank runs the pass)
        self.e_proj = v4_linear(hidden, hidden, quant)
        self.h_proj = v4_linear(hidden, hidden, quant)
        self.hc_head = HyperHead(cfg.hc_mult, hidden, cfg.hc_eps, eps)
        self.block = block

    def forward(
        self,
        embedded: torch.Tensor,
        positions: torch.Tensor,
        previous: torch.Tensor,
        input_ids: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Output streams [T, hc_mult, hidden] at each position from the embedding of the token after it and the
        streams there: the main model's after its last block, or this layer's own for a later draft."""
        h = self.h_proj(self.hnorm(previous).flatten(0, 1)).view_as(previous)
        x = (self.e_proj(self.enorm(embedded))[:, None] + h).contiguous()
        return self.block(positions, x, input_ids, kv_cache, meta)

    def head_input(self, streams: torch.Tensor) -> torch.Tensor:
        """What the shared LM head reads: the streams collapsed by this layer's own hc_head, then its norm."""
        return self.norm(self.hc_head(streams))


def build_mtp_layers(cfg: object, count: int, make_block, quant: BlockFP8Config | None) -> nn.ModuleList:
    """`count` MTP layers; make_block(index, kinds) builds block number index of the given kinds."""
    return nn.ModuleList(
        V4MTP(cfg, make_block(cfg.num_hidden_layers + k, mtp_block_kinds(cfg, k)), quant)
        for k in range(count)
    )


class V4MtpMethods:
    """The causal LM's side of its MTP layers (self.mtp, built by build_mtp_layers): what the draft pass calls."""

    def cached_layers(self) -> list[nn.Module]:
        """The blocks with a cache of their own: the main model's, then the MTP layers' (kv_cache_spec's order)."""
        return [*self.model.layers, *(m.block for m in self.mtp)]

    def mtp_forward(
        self,
        k: int,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        previous: torch.Tensor,
        kv_caches: list,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """MTP layer k's output streams; its cache is the one after the main model's blocks'."""
        cache = kv_caches[self.cfg.num_hidden_layers + k]
        embedded = self.model.embed_tokens(input_ids)
        return self.mtp[k](embedded, positions, previous, input_ids, cache, meta)

    def mtp_logits(self, k: int, streams: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(self.mtp[k].head_input(streams))
