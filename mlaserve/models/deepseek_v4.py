"""DeepSeek-V4: shared-KV attention over a sliding window plus compressed entries, hyper-connections, hash-routed
and score-routed MoE; torch reference, whose decode and prefill attention run on the paged Triton kernels where the
backend does (attention/v4_decode.py, v4_prefill.py).

Each layer's attention is one of three kinds (config.layer_types): "sliding_attention" (the last sliding_window
tokens), "heavily_compressed_attention" (the window plus every compressed entry of rate compress_rates[...], 128 in
V4) and "compressed_sparse_attention" (the window plus the index_topk entries of rate 4 that the lightning indexer
picks). One head of head_dim is both key and value for all query heads; every head has a learned sink logit in its
softmax; the rotary part (the last qk_rope_head_dim features, interleaved pairs) of the output is rotated back by
the query's position before the grouped low-rank output projection.

Cache groups: every layer keeps one row per token in a sliding-window group (the rotated kv, then the kv and gate
projections of its compressor and its indexer, layers/compressor.py), whose window reaches as far back as the
attention window and every compressor's span; its blocks go back to the pool as they leave it. Each compression rate
has a group of its own (KVCacheSpec.entry_rules), one slot per `rate` tokens: a layer's compressed entry (then its
indexer key) is made once, by the step that computes the entry's last token, from the rows the window group still
holds, and stored in the layer's entry tensor at its entry slot. So a long sequence's cache grows by a slot per
`rate` tokens of each rate, not one per token (kv_bytes_per_token says how much). Each group has a pool of its own:
a compressing layer's cache is (rows, entries), its entries in a tensor of its entry group's blocks and only as wide
as an entry (kv, then the indexer key), so an entry block costs only what that rate's layers store.
"""

import re

import torch
from torch import nn

from mlaserve.attention.backend import write_to_cache
from mlaserve.attention.metadata import AttentionMetadata, slot_indices
from mlaserve.attention.v4_decode import decode_on_kernels, describe_v4_decode
from mlaserve.attention.v4_prefill import prefill_on_kernels
from mlaserve.config.quantization import BlockFP8Config
from mlaserve.kvcache import segments
from mlaserve.kvcache.spec import AttentionRule, KVCacheSpec, LayerCacheSpec
from mlaserve.layers.compressor import CompressedIndexer, Compressor
from mlaserve.layers.embedding import VocabParallelEmbedding
from mlaserve.layers.hyper_connection import HyperConnection, HyperHead, unweighted_rms_norm
from mlaserve.layers.norm import Float32RMSNorm
from mlaserve.layers.rotary import RotaryEmbedding, rotate_trailing_pairs
from mlaserve.loader.checkpoint_slice import default_weight_loader
from mlaserve.models.base import CausalLM, ModelInit
from mlaserve.models.deepseek_v4_ffn import GroupedLinear, V4MoE, local_experts, v4_linear
from mlaserve.models.deepseek_v4_mtp import V4MtpMethods, build_mtp_layers, mtp_param_name
from mlaserve.parallel import SINGLE, ParallelContext

_HC = re.compile(r"\.hc_(attn|ffn)_(fn|base|scale)$")
_SCALE = re.compile(r"(?<!_hc)\.scale$")  # not the hyper-connections' own `scale` (attn_hc.scale)
_EXPERT = re.compile(r"\.experts\.(\d+)\.(w[123])\.(weight|weight_scale_inv)$")
_RENAMES = {"embed.weight": "model.embed_tokens.weight", "head.weight": "lm_head.weight"}
SLIDING, HEAVY, SPARSE = "sliding_attention", "heavily_compressed_attention", "compressed_sparse_attention"


def v4_rope(cfg: object, kind: str) -> torch.Tensor:
    """inv_freq [qk_rope_head_dim / 2] of the "main" (sliding layers) or "compress" rotary (the rest)."""
    params = cfg.rope_parameters[kind]
    dim = cfg.qk_rope_head_dim
    if params.get("rope_type", "default") == "default":
        return 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    with torch.device("cpu"):  # its own tensors: not on the meta device the weights are first sized on
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[params["rope_type"]](cfg, "cpu", layer_type=kind)
    if scaling != 1.0:  # the reference applies no attention factor to the compressed rotary
        raise ValueError(
            f"config.json: rope_parameters[{kind!r}] gives an attention factor {scaling}; V4 uses 1.0"
        )
    return inv_freq.float()


def entry_spans(cfg: object) -> dict[int, int]:
    """Each compression rate of the model's layers -> the tokens an entry of that rate pools (2 x rate where a
    compressed-sparse layer's overlapping compressors use it), in increasing rate: entry group 1, 2, ..."""
    spans: dict[int, int] = {}
    for kind in cfg.layer_types:
        if kind != SLIDING:
            rate = cfg.compress_rates[kind]
            spans[rate] = max(spans.get(rate, 0), 2 * rate if kind == SPARSE else rate)
    return dict(sorted(spans.items()))


def head_slice_loader(ctx: ParallelContext):
    """A per-head parameter's loader: this rank's heads of the checkpoint's every-head tensor."""

    def load(param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
        n = param.shape[0]
        default_weight_loader(param, loaded.narrow(0, ctx.tp_rank * n, n) if loaded.shape[0] != n else loaded)

    return load


class V4Attention(nn.Module):
    """Over tensor-parallel ranks each holds its share of the query heads (whole output groups) and their sinks;
    the one shared kv head, the compressors and the indexer are every rank's, so each rank caches the same rows."""

    def __init__(
        self, cfg: object, layer_type: str, quant: BlockFP8Config | None = None, ctx: ParallelContext = SINGLE
    ) -> None:
        super().__init__()
        self.head_dim, self.window = cfg.head_dim, cfg.sliding_window
        self.num_heads = ctx.shard(cfg.num_attention_heads, "num_attention_heads")
        self.o_groups = ctx.shard(cfg.o_groups, "o_groups")
        self.eps, self.scale = cfg.rms_norm_eps, cfg.head_dim**-0.5
        # DeepSeek's checkpoint names: wq_a / q_norm / wq_b the low-rank query path, wkv / norm the shared kv,
        # wo_a / wo_b the grouped output projection, attn_sink each head's sink logit
        self.wq_a = v4_linear(cfg.hidden_size, cfg.q_lora_rank, quant)
        self.q_norm = Float32RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.wq_b = v4_linear(cfg.q_lora_rank, cfg.num_attention_heads * self.head_dim, quant, ctx, "column")
        self.wkv = v4_linear(cfg.hidden_size, self.head_dim, quant)
        self.norm = Float32RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.wo_a = GroupedLinear(
            cfg.num_attention_heads * self.head_dim // cfg.o_groups,
            cfg.o_groups * cfg.o_lora_rank,
            cfg.o_groups,
            quant,
            ctx,
        )
        self.wo_b = v4_linear(cfg.o_groups * cfg.o_lora_rank, cfg.hidden_size, quant, ctx, "row")
        self.attn_sink = nn.Parameter(torch.empty(self.num_heads, dtype=torch.float32), requires_grad=False)
        self.attn_sink.weight_loader = head_slice_loader(ctx)
        self.rotary = RotaryEmbedding(v4_rope(cfg, "main" if layer_type == SLIDING else "compress"))
        # decode and prefill on the Triton kernels (attention/v4_decode.py, v4_prefill.py) where the backend runs them
        self.on_kernels = False
        self.compressor: Compressor | None = None
        self.indexer: CompressedIndexer | None = None
        if layer_type != SLIDING:
            rate = cfg.compress_rates[layer_type]
            self.compressor = Compressor(
                cfg.hidden_size, self.head_dim, rate, layer_type == SPARSE, cfg.rms_norm_eps
            )
            self.entry_rotary = RotaryEmbedding(v4_rope(cfg, "compress"))
            self.entry_group = 1 + list(entry_spans(cfg)).index(rate)  # group 0: every layer's rows
        if layer_type == SPARSE:
            self.indexer = CompressedIndexer(
                cfg.hidden_size, cfg.q_lora_rank, cfg.index_n_heads, cfg.index_head_dim, rate, cfg.index_topk,
                cfg.rms_norm_eps, quant,
            )  # fmt: skip

    @property
    def row_parts(self) -> tuple[int, ...]:
        """Widths of what one token caches: its kv, then its compressor's and indexer's projections (each part
        scaled on its own in 8-bit caches, kvcache/segments.py)."""
        parts = [self.head_dim]
        if self.compressor is not None:
            parts.append(self.compressor.state_width)
        if self.indexer is not None:
            parts.append(self.indexer.compressor.state_width)
        return tuple(parts)

    @property
    def entry_parts(self) -> tuple[int, ...]:
        """Widths of what one compressed entry stores: its kv, then its indexer key (none: no entries)."""
        if self.compressor is None:
            return ()
        return (self.head_dim,) + ((self.indexer.head_dim,) if self.indexer is not None else ())

    @property
    def row_width(self) -> int:
        return sum(self.row_parts)

    @property
    def entry_width(self) -> int:
        return sum(self.entry_parts)

    def entry_values(
        self, made: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(kv [..., head_dim], indexer keys [..., index_head_dim] or None) of cached entries, in `dtype`."""
        parts = self.entry_parts
        keys = segments.read(made, parts, 1, dtype) if len(parts) > 1 else None
        return segments.read(made, parts, 0, dtype), keys

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, kv_cache, meta: AttentionMetadata
    ) -> torch.Tensor:
        """kv_cache: the rows' tensor, or (rows, entries) for a compressing layer (a pool per cache group)."""
        num_tokens = hidden.shape[0]
        cos, sin = self.rotary.cos_sin(positions)
        q_resid = self.q_norm(self.wq_a(hidden))
        q = unweighted_rms_norm(self.wq_b(q_resid).view(num_tokens, self.num_heads, self.head_dim), self.eps)
        q = rotate_trailing_pairs(q, cos, sin)
        rows = [rotate_trailing_pairs(self.norm(self.wkv(hidden))[:, None], cos, sin)[:, 0]]
        if self.compressor is not None:
            rows.append(self.compressor.state(hidden))
        if self.indexer is not None:
            rows.append(self.indexer.compressor.state(hidden))
        row_cache, entry_cache = kv_cache if self.compressor is not None else (kv_cache, None)
        # group 0: the rows
        write_to_cache(row_cache, meta.slot_mapping, segments.pack(rows, row_cache.dtype)[:, None])
        cached = row_cache.view(-1, row_cache.shape[-1])
        entries = stored = None
        if self.compressor is not None and meta.groups is not None:  # None: the runner's warm-up pass
            entries = meta.groups[self.entry_group]
            stored = entry_cache.view(-1, entry_cache.shape[-1])
            self._write_entries(entry_cache, cached, entries)
        out, nd = torch.empty_like(q), meta.num_decodes
        if nd:
            decode = decode_on_kernels if self.on_kernels else V4Attention._decode
            out[:nd] = decode(
                self, q[:nd], q_resid[:nd], hidden[:nd], positions[:nd], cached, meta, entries, stored
            )
        if meta.num_seqs > nd:
            prefill = prefill_on_kernels if self.on_kernels else V4Attention._prefill
            out[nd:] = prefill(
                self, q[nd:], q_resid[nd:], hidden[nd:], positions[nd:], cached, meta, entries, stored
            )
        out = rotate_trailing_pairs(out, cos, -sin)  # the values' rotation, undone at the query's position
        return self.wo_b(self.wo_a(out.reshape(num_tokens, self.o_groups, -1)))

    def _prefill(
        self, q, q_resid, hidden, positions, cached, meta: AttentionMetadata, entries, stored
    ) -> torch.Tensor:
        """The prefills' query tokens [T, H, D] (the step's tokens after its decodes), a sequence at a time through
        _attend: its window's rows (from the first query's window on: older rows may be gone) and complete
        entries."""
        out, start = torch.empty_like(q), 0
        for i in range(meta.num_decodes, meta.num_seqs):
            q_len, n = meta.query_lens[i], meta.host_seq_lens[i]
            first = max(0, n - q_len - self.window + 1)
            slots = slot_indices(meta.block_tables[i], n, meta.block_size, first)
            window = segments.read(cached, self.row_parts, 0, q.dtype, at=slots)
            made = None
            if entries is not None and n // self.compressor.rate:
                slots = slot_indices(entries.block_tables[i], n // self.compressor.rate, meta.block_size)
                made = self.entry_values(stored[slots], q.dtype)
            part = slice(start, start + q_len)
            out[part] = self._attend(
                q[part], q_resid[part], hidden[part], positions[part], window, first, made
            )
            start += q_len
        return out

    def _write_entries(
        self, entry_cache: torch.Tensor, cached: torch.Tensor, entries: AttentionMetadata
    ) -> None:
        """The entries this step completes (and their indexer keys), from their tokens' rows (cached), at their
        slots of the entries' own tensor."""
        sources = entries.pooled_sources
        if not sources.shape[0]:
            return
        valid = sources >= 0
        cos, sin = self.entry_rotary.cos_sin(entries.pooled_starts)
        dtype, parts = self.compressor.wkv.weight.dtype, self.row_parts  # the projections' own dtype
        at = sources.clamp(min=0)
        row = [self.compressor.pool(segments.read(cached, parts, 1, dtype, at), valid, cos, sin)]
        if self.indexer is not None:
            row.append(
                self.indexer.compressor.pool(segments.read(cached, parts, 2, dtype, at), valid, cos, sin)
            )
        write_to_cache(entry_cache, entries.slot_mapping, segments.pack(row, entry_cache.dtype)[:, None])

    def _decode(
        self, q, q_resid, hidden, positions, cached, meta: AttentionMetadata, entries, stored
    ) -> torch.Tensor:
        """The decode rows [B, H, D] at once: each query over the window's kv and its complete entries, gathered
        through the tables to widths fixed by the longest context the step allows (max_model_len in a captured
        step), so a CUDA graph can replay it. The same rule as _attend, which the prefills use."""
        b, bs = q.shape[0], meta.block_size
        n = meta.seq_lens[:b].long()
        pos = n[:, None] - self.window + torch.arange(self.window, device=q.device)
        visible = pos >= 0
        pos = pos.clamp(min=0)
        slots = meta.block_tables[:b].long().gather(1, pos // bs) * bs + pos % bs
        keys = segments.read(cached, self.row_parts, 0, q.dtype, at=slots)  # [B, window, D]
        count = max(meta.host_seq_lens[:b]) // self.compressor.rate if entries is not None else 0
        if count:
            e = torch.arange(count, device=q.device)
            slots = entries.block_tables[:b].long()[:, e // bs] * bs + e % bs
            made = self.entry_values(stored[slots], q.dtype)  # [B, count, D], [B, count, index_head_dim]
            complete = e[None, :] < (n // self.compressor.rate)[:, None]
            keys = torch.cat((keys, made[0]), dim=1)
            visible = torch.cat(
                (visible, self._kept_entries(q_resid, hidden, positions, made, complete)), dim=1
            )
        probs = self._sink_probs(torch.einsum("bhd,bkd->bhk", q, keys), visible)
        return torch.einsum("bhk,bkd->bhd", probs.to(keys.dtype), keys)

    def _attend(
        self, q, q_resid, hidden, positions, window: torch.Tensor, first: int, entries
    ) -> torch.Tensor:
        """One sequence's queries [q_len, H, D] over its window's kv [k, D] (positions first..) and its complete
        compressed entries (entry_values: kv [E, D], indexer keys; the layer's rule picks the ones each query
        sees), with the sinks in every head's softmax."""
        key_pos = torch.arange(first, first + window.shape[0], device=window.device)
        visible = (key_pos[None, :] <= positions[:, None]) & (
            key_pos[None, :] > positions[:, None] - self.window
        )
        keys = window
        if entries is not None:
            rate = self.compressor.rate
            complete = (
                torch.arange(entries[0].shape[0], device=window.device)[None, :]
                < ((positions + 1) // rate)[:, None]
            )
            keys = torch.cat((keys, entries[0]))
            visible = torch.cat(
                (visible, self._kept_entries(q_resid, hidden, positions, entries, complete)), dim=1
            )
        probs = self._sink_probs(torch.einsum("thd,kd->thk", q, keys), visible)
        return torch.einsum("thk,kd->thd", probs.to(keys.dtype), keys)

    def _kept_entries(
        self, q_resid, hidden, positions, entries: tuple, complete: torch.Tensor
    ) -> torch.Tensor:
        """[T, E] the entries each query attends: the complete ones or, in a compressed-sparse layer, the indexer's
        top-k of them, scored on the indexer keys stored after each entry's kv (entry_values: keys [E or T x E,
        index_head_dim])."""
        if self.indexer is None:
            return complete
        index_keys = entries[1]
        return self.indexer.select(
            q_resid, hidden, *self.entry_rotary.cos_sin(positions), index_keys, complete
        )

    def _sink_probs(self, logits: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """Attention weights [T, H, K] from q.k logits [T, H, K] where visible [T, K], each head's sink logit in its
        softmax (the sink's own weight dropped: it attends to nothing)."""
        logits = logits.float().mul(self.scale).masked_fill(~visible[:, None], float("-inf"))
        logits = torch.cat((logits, self.attn_sink[None, :, None].expand(logits.shape[0], -1, 1)), dim=-1)
        return torch.softmax(logits - logits.amax(dim=-1, keepdim=True), dim=-1)[..., :-1]


class V4DecoderLayer(nn.Module):
    def __init__(
        self, cfg: object, idx: int, quant: BlockFP8Config | None = None, ctx: ParallelContext = SINGLE,
        kinds: tuple[str, str] | None = None,
    ) -> None:  # fmt: skip
        """kinds: (attention kind, MoE kind), given for an MTP layer's block; else config.json's for layer idx."""
        super().__init__()
        attention, moe = kinds or (cfg.layer_types[idx], cfg.mlp_layer_types[idx])
        self.attn = V4Attention(cfg, attention, quant, ctx)
        self.ffn = V4MoE(cfg, moe == "hash_moe", quant, ctx)
        self.attn_norm = Float32RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.ffn_norm = Float32RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        hc = (cfg.hc_mult, cfg.hidden_size, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps)
        self.attn_hc, self.ffn_hc = HyperConnection(*hc), HyperConnection(*hc)

    def forward(self, positions, streams, input_ids, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        post, comb, x = self.attn_hc(streams)
        streams = HyperConnection.merge(
            streams, self.attn(positions, self.attn_norm(x), kv_cache, meta), post, comb
        )
        post, comb, x = self.ffn_hc(streams)
        return HyperConnection.merge(streams, self.ffn(self.ffn_norm(x), input_ids), post, comb)


class V4Model(nn.Module):
    def __init__(self, cfg: object, ctx: ParallelContext, quant: BlockFP8Config | None = None) -> None:
        super().__init__()
        self.hc_mult = cfg.hc_mult
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, ctx)
        self.layers = nn.ModuleList(V4DecoderLayer(cfg, i, quant, ctx) for i in range(cfg.num_hidden_layers))
        self.hc_head = HyperHead(cfg.hc_mult, cfg.hidden_size, cfg.hc_eps, cfg.rms_norm_eps)
        self.norm = Float32RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids, positions, kv_caches, meta: AttentionMetadata) -> torch.Tensor:
        return self.forward_with_prenorm(input_ids, positions, kv_caches, meta)[0]

    def forward_with_prenorm(self, input_ids, positions, kv_caches, meta: AttentionMetadata) -> tuple:
        """(the final norm's output, the streams after the last block: what an MTP layer reads). kv_caches may
        hold the MTP layers' caches after the blocks'."""
        streams = self.embed_tokens(input_ids)[:, None, :].expand(-1, self.hc_mult, -1).contiguous()
        for layer, kv_cache in zip(self.layers, kv_caches[: len(self.layers)], strict=True):
            streams = layer(positions, streams, input_ids, kv_cache, meta)
        return self.norm(self.hc_head(streams)), streams


class DeepseekV4ForCausalLM(V4MtpMethods, CausalLM):
    attends_itself = True
    # Its decode rows are batched with shapes fixed by max_model_len (V4Attention._decode): capturable.
    supports_cuda_graphs = True
    supports_prefill_graphs = False  # prefills loop over their sequences on the host
    training_free_window = False  # its cached rows feed the compressors: a window would drop what they need
    supports_block_fp8 = True  # FP8 projections; MXFP4 routed experts with expert_dtype "fp4"
    supports_mxfp4_experts = True
    supports_tensor_parallel = True  # heads by rank, experts by width or whole (expert parallelism)
    segmented_8bit_cache = True  # each part of its rows and entries scaled on its own (kvcache/segments.py)
    supports_mtp = (
        True  # its checkpoints ship num_nextn_predict_layers MTP layers (models/deepseek_v4_mtp.py)
    )

    def __init__(self, init: ModelInit) -> None:
        super().__init__()
        self.cfg = init.hf_config
        self.model = V4Model(self.cfg, init.ctx, init.quant)
        self.mtp = build_mtp_layers(
            self.cfg, init.mtp_layers, lambda i, kinds: V4DecoderLayer(self.cfg, i, init.quant, init.ctx, kinds),
            init.quant,
        )  # fmt: skip
        self.fp4_experts = init.quant is not None and init.quant.expert_dtype == "fp4"
        # this rank's experts (all but under expert parallelism): a checkpoint's others are not loaded here
        self.local_experts = local_experts(self.cfg.n_routed_experts, init.ctx)
        on_kernels = (
            init.backend is not None and init.backend.paged_kernels
        )  # None: a meta build that runs nothing
        for layer in self.cached_layers():
            layer.attn.on_kernels = on_kernels
        self.build_lm_head(self.cfg, init.ctx)

    def attention_kernels(self, backend, cache_dtype: torch.dtype, device, dtype: torch.dtype) -> str:
        heads = self.model.layers[0].attn.num_heads  # this rank's, as its kernels see them
        return describe_v4_decode(backend, heads, self.cfg.head_dim, cache_dtype, device, dtype)

    def map_checkpoint_name(self, name: str) -> tuple[str, object] | None:
        """DeepSeek's names as transformers saves them (model.layers.N.attn.wq_a, head.weight) or as DeepSeek ships
        them (layers.N..., embed.weight, hc_head_fn); hyper-connection weights are flat on the layer there."""
        if name.startswith(("layers.", "norm.", "embed.", "hc_head_")):
            name = "model." + name
        if (name := mtp_param_name(name, len(self.mtp))) is None:  # an MTP layer not built
            return None
        name = _RENAMES.get(name.removeprefix("model."), name)
        # a quantized weight's scales: `.scale` as DeepSeek ships them, `.weight_scale_inv` as transformers names
        # them; some transformers versions save the hyper-connections under their module names (attn_hc.scale)
        name = _SCALE.sub(".weight_scale_inv", name)
        name = _HC.sub(r".\1_hc.\2", name).replace("model.hc_head_", "model.hc_head.hc_")
        if (expert := _EXPERT.search(name)) is not None:
            index, n_routed = int(expert[1]), self.cfg.n_routed_experts
            if index not in self.local_experts and index < n_routed:  # another rank's; past the end: an error
                return None
            local = index - self.local_experts.start
            name = f"{name[: expert.start()]}.experts.{local}.{expert[2]}.{expert[3]}"
        if self.fp4_experts and (expert := _EXPERT.search(name)) is not None:
            index, proj, kind = int(expert[1]), expert[2], expert[3]
            param = ("w2" if proj == "w2" else "w13") + ("_scale" if kind == "weight_scale_inv" else "")
            shard = index if proj == "w2" else (index, 0 if proj == "w1" else 1)
            return name[: expert.start()] + ".experts." + param, shard
        return super().map_checkpoint_name(name)

    def kv_cache_spec(self) -> KVCacheSpec:
        spans = entry_spans(self.cfg)
        window = max(self.cfg.sliding_window, *spans.values())  # the rows every compressor still reads
        layers = tuple(
            LayerCacheSpec(
                1,
                layer.attn.row_width,
                False,
                window=window,
                entry_dim=layer.attn.entry_width,
                entry_ratio=layer.attn.compressor.rate if layer.attn.compressor is not None else None,
                row_parts=len(layer.attn.row_parts),
                entry_parts=max(len(layer.attn.entry_parts), 1),
            )
            for layer in self.cached_layers()
        )
        rules = tuple(AttentionRule(window, 0, rate, span) for rate, span in spans.items())
        return KVCacheSpec(layers, is_mla=False, entry_rules=rules, segmented_8bit=True)
