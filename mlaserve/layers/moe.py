"""Mixture of experts: DeepSeek routers (V2 softmax, V3 sigmoid with correction bias) and fused expert weights.

Experts live in two stacked tensors so a grouped kernel can replace the per-expert loop without touching
loading; `experts_reference` is the plain loop that any faster path is checked against. Shared experts can live
there too, after the routed ones: the router then routes every token to each of them with weight 1, so one grouped
GEMM per projection runs the routed and the shared experts (SGLang's shared-experts fusion) instead of a second
MLP of three more launches per layer.
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from mlaserve.config.quantization import BlockFP8Config
from mlaserve.kernels.registry import FUSED_MOE, GATE_LOGITS, ROUTE_GREEDY
from mlaserve.layers.activation import get_act_fn
from mlaserve.layers.block_fp8 import FP8, dequantize, fake_quantize_per_token_group
from mlaserve.layers.fp8_params import (
    Part,
    check_column_split,
    group_rows,
    scale_param,
    store_scale,
    store_weight,
)
from mlaserve.layers.linear import make_param
from mlaserve.loader.checkpoint_slice import ShapeMismatch, default_weight_loader, slice_aware
from mlaserve.parallel import ParallelContext


def route_softmax(logits: torch.Tensor, top_k: int, method: str, n_group: int, topk_group: int):
    """DeepSeek-V2: softmax scores; greedy or group-limited greedy (best experts of the top groups by max)."""
    scores = logits.softmax(dim=-1)
    if method == "group_limited_greedy":
        grouped = scores.view(scores.shape[0], n_group, -1)
        keep = torch.zeros(grouped.shape[:2], dtype=torch.bool, device=scores.device)
        keep.scatter_(1, grouped.amax(dim=-1).topk(topk_group, dim=-1, sorted=False)[1], True)
        scores = scores.masked_fill(~keep.repeat_interleave(grouped.shape[-1], dim=1), 0.0)
    elif method != "greedy":
        raise ValueError(
            f"unsupported topk_method {method!r} for softmax routing; use greedy or group_limited_greedy"
        )
    return scores.topk(top_k, dim=-1, sorted=False)


def route_sigmoid(logits: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int, topk_group: int):
    """DeepSeek-V3: sigmoid scores; the correction bias steers the choice only, groups ranked by their top-2 sum."""
    scores = logits.sigmoid()
    biased = scores + bias
    grouped = biased.view(scores.shape[0], n_group, -1)
    keep = torch.zeros(grouped.shape[:2], dtype=torch.bool, device=scores.device)
    keep.scatter_(1, grouped.topk(2, dim=-1)[0].sum(dim=-1).topk(topk_group, dim=-1, sorted=False)[1], True)
    biased = biased.masked_fill(~keep.repeat_interleave(grouped.shape[-1], dim=1), float("-inf"))
    ids = biased.topk(top_k, dim=-1, sorted=False)[1]
    return scores.gather(1, ids), ids


def with_shared_experts(
    weights: torch.Tensor, ids: torch.Tensor, num_experts: int, num_shared: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The routing with the shared experts (ids num_experts, num_experts + 1, ..., weight 1) appended to every
    token's routes."""
    if not num_shared:
        return weights, ids
    shared = torch.arange(num_experts, num_experts + num_shared, device=ids.device, dtype=ids.dtype)
    return (
        torch.cat((weights, weights.new_ones(weights.shape[0], num_shared)), dim=1),
        torch.cat((ids, shared.expand(ids.shape[0], -1)), dim=1),
    )


class MoEGate(nn.Module):
    """Routes each token to its top-k experts; with num_shared, also to the shared experts stored after them
    (with_shared_experts)."""

    def __init__(self, cfg: object, sigmoid: bool, num_shared: int = 0) -> None:
        super().__init__()
        self.num_experts, self.num_shared = cfg.n_routed_experts, num_shared
        self.top_k, self.sigmoid = cfg.num_experts_per_tok, sigmoid
        self.n_group, self.topk_group = cfg.n_group or 1, cfg.topk_group or 1
        if self.num_experts % self.n_group:
            raise ValueError(
                f"n_routed_experts={self.num_experts} is not divisible by n_group={self.n_group}"
            )
        self.method = getattr(cfg, "topk_method", "greedy")
        self.normalize = bool(getattr(cfg, "norm_topk_prob", False))
        self.scaling = float(getattr(cfg, "routed_scaling_factor", 1.0) or 1.0)
        # Routing is decided in float32, as the reference does: bf16 logits flip near-tied experts.
        self.weight = make_param(self.num_experts, cfg.hidden_size, dtype=torch.float32)
        if sigmoid:
            self.e_score_correction_bias = make_param(self.num_experts, dtype=torch.float32)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        gate = GATE_LOGITS.choose(x, self.weight)  # one launch for a decode-sized batch's float32 gate GEMM
        logits = gate(x, self.weight) if gate else F.linear(x.float(), self.weight)
        # greedy routing: scores and top-k in one launch on CUDA
        greedy = self.n_group == 1 if self.sigmoid else self.method == "greedy"
        bias = self.e_score_correction_bias if self.sigmoid else None
        route = (logits, bias, self.top_k, self.normalize, self.scaling, self.num_shared)
        if greedy and (kernel := ROUTE_GREEDY.choose(*route)) is not None:
            return kernel(*route)
        if self.sigmoid:
            weights, ids = route_sigmoid(
                logits, self.e_score_correction_bias, self.top_k, self.n_group, self.topk_group
            )
        else:
            weights, ids = route_softmax(logits, self.top_k, self.method, self.n_group, self.topk_group)
        if self.normalize and self.top_k > 1:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return with_shared_experts(weights * self.scaling, ids, self.num_experts, self.num_shared)


class FusedExperts(nn.Module):
    """w13: [E, 2I, hidden] (gate rows then up rows), w2: [E, hidden, I].

    Tensor parallel: every rank holds every expert, I split across ranks. Expert parallel (ctx.expert_parallel):
    each rank holds E / ranks whole experts, applies them to the tokens routed to them, and the same all-reduce as
    tensor parallelism sums the ranks' parts (no all-to-all: every rank sees every token already).

    num_shared: the MoE's shared experts (a checkpoint's one shared MLP of num_shared x I) stored as that many
    experts of width I after the routed ones, each split over ranks like a routed expert; the router sends every
    token to them (MoEGate's num_shared). Not with expert parallelism, where every rank would need them whole.

    quant: w13 and w2 are block FP8, their scales in w13_scale and w2_scale (layers/fp8_params.py), one row
    grouping for both so one kernel argument serves the two GEMMs."""

    def __init__(
        self,
        num_experts: int,
        hidden: int,
        intermediate: int,
        act: str,
        ctx: ParallelContext,
        num_shared: int = 0,
        quant: BlockFP8Config | None = None,
    ) -> None:
        super().__init__()
        if num_shared and ctx.expert_parallel:
            raise ValueError("shared experts are stored with the routed ones only without expert parallelism")
        self.ctx = ctx
        if ctx.expert_parallel:  # this rank's run of whole experts
            self.num_local = ctx.shard(num_experts, "n_routed_experts")
            self.first, self.inter = ctx.tp_rank * self.num_local, intermediate
        else:  # every expert, this rank's slice of its width
            self.num_local, self.first = num_experts, 0
            self.inter = ctx.shard(intermediate, "moe_intermediate_size")
        self.num_shared = num_shared
        # the width split a checkpoint tensor is narrowed by: none with expert parallelism
        self.inter_rank, self.inter_ranks = (0, 1) if ctx.expert_parallel else (ctx.tp_rank, ctx.tp_size)
        self.act = get_act_fn(act)
        local = range(self.first, self.first + self.num_local)
        w13_shards = frozenset((e, i) for e in local for i in (0, 1))
        w2_shards = frozenset(local)
        if num_shared:
            w13_shards |= {("shared", 0), ("shared", 1)}
            w2_shards |= {"shared"}
        total = self.num_local + num_shared
        self.quant, self.hidden = quant, hidden
        dtype = FP8 if quant else None
        self.w13 = make_param(
            total, 2 * self.inter, hidden, loader=self.load_w13, shards=w13_shards, dtype=dtype
        )
        self.w2 = make_param(total, hidden, self.inter, loader=self.load_w2, shards=w2_shards, dtype=dtype)
        if quant:
            split = self.inter_ranks > 1
            self.group_n = min(
                group_rows(quant, [self.inter, self.inter], split), group_rows(quant, [hidden], False)
            )
            check_column_split(quant, self.inter, self.inter_ranks, "the experts' down_proj")
            rows13 = (total, 2 * self.inter)
            self.w13_scale = scale_param(rows13, hidden, self.group_n, self.load_w13_scale, w13_shards)
            self.w2_scale = scale_param(
                (total, hidden), self.inter, self.group_n, self.load_w2_scale, w2_shards
            )

    def _local(self, expert: int) -> int | None:
        index = expert - self.first
        return index if 0 <= index < self.num_local else None

    def _shared_parts(self, loaded, dim: int, name: str) -> list:
        """The shared MLP's checkpoint tensor cut into its experts' widths along dim (this rank's slice of each)."""
        full = self.inter * self.inter_ranks
        if loaded.shape[dim] != full * self.num_shared:
            raise ShapeMismatch(
                f"shared experts' {name}: checkpoint width {loaded.shape[dim]} along dim {dim}, expected "
                f"n_shared_experts x moe_intermediate_size = {self.num_shared} x {full}"
            )
        return [
            loaded.narrow(dim, j * full + self.inter_rank * self.inter, self.inter)
            for j in range(self.num_shared)
        ]

    def _store(
        self, param: torch.Tensor, index: int, loaded: torch.Tensor, part: Part, shard_id: object
    ) -> None:
        """One expert's part of w13 or w2: copied, or for FP8 weights stored with its scales."""
        if not self.quant:
            default_weight_loader(param.data[index].narrow(0, part.offset, part.size), loaded)
            return
        scale = self.w13_scale if param is self.w13 else self.w2_scale
        store_weight(param.data[index], scale, scale.data[index], loaded, part, self.group_n, shard_id)

    def _w13_part(self, which: int, first: int) -> Part:
        return Part(which * self.inter, self.inter, first, 0)

    def _w2_part(self, col0: int) -> Part:
        return Part(0, self.hidden, 0, col0)

    def _shared_start(self, j: int) -> int:
        """Shared expert j's first row (w13) or column (w2) in the shared MLP's checkpoint tensor."""
        return j * self.inter * self.inter_ranks + self.inter_rank * self.inter

    @slice_aware
    def load_w13(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: tuple) -> None:
        expert, which = shard_id
        if expert == "shared":  # gate_proj (0) or up_proj (1) of the shared MLP
            for j, part in enumerate(self._shared_parts(loaded, 0, ("gate_proj", "up_proj")[which])):
                self._store(
                    param, self.num_local + j, part, self._w13_part(which, self._shared_start(j)), shard_id
                )
            return
        if (index := self._local(expert)) is None:
            return  # another rank's expert
        if loaded.shape[0] == self.inter * self.inter_ranks:
            loaded = loaded.narrow(0, self.inter_rank * self.inter, self.inter)
        self._store(param, index, loaded, self._w13_part(which, self.inter_rank * self.inter), shard_id)

    @slice_aware
    def load_w2(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: int | str) -> None:
        if shard_id == "shared":  # the shared MLP's down_proj
            for j, part in enumerate(self._shared_parts(loaded, 1, "down_proj")):
                self._store(param, self.num_local + j, part, self._w2_part(self._shared_start(j)), shard_id)
            return
        if (index := self._local(shard_id)) is None:
            return
        if loaded.shape[1] == self.inter * self.inter_ranks:
            loaded = loaded.narrow(1, self.inter_rank * self.inter, self.inter)
        self._store(param, index, loaded, self._w2_part(self.inter_rank * self.inter), shard_id)

    @slice_aware
    def load_w13_scale(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: tuple) -> None:
        expert, which = shard_id
        full_rows = self.inter * self.inter_ranks
        if expert == "shared":
            full = (full_rows * self.num_shared, self.hidden)
            for j in range(self.num_shared):
                part = self._w13_part(which, self._shared_start(j))
                store_scale(
                    param.data[self.num_local + j], loaded, part, self.hidden, full, self.group_n, self.quant
                )
            return
        if (index := self._local(expert)) is not None:
            part = self._w13_part(which, self.inter_rank * self.inter)
            store_scale(
                param.data[index],
                loaded,
                part,
                self.hidden,
                (full_rows, self.hidden),
                self.group_n,
                self.quant,
            )

    @slice_aware
    def load_w2_scale(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: int | str) -> None:
        full_cols = self.inter * self.inter_ranks
        if shard_id == "shared":
            full = (self.hidden, full_cols * self.num_shared)
            for j in range(self.num_shared):
                part = self._w2_part(self._shared_start(j))
                store_scale(
                    param.data[self.num_local + j], loaded, part, self.inter, full, self.group_n, self.quant
                )
            return
        if (index := self._local(shard_id)) is not None:
            part = self._w2_part(self.inter_rank * self.inter)
            store_scale(
                param.data[index],
                loaded,
                part,
                self.inter,
                (self.hidden, full_cols),
                self.group_n,
                self.quant,
            )

    def forward(
        self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, add: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The routed experts' output, plus `add` (a full, already reduced [T, hidden] tensor) if given."""
        if self.ctx.expert_parallel:  # this rank's experts only: the others' routes become -1
            local = ids - self.first
            ids = torch.where((local >= 0) & (local < self.num_local), local, -1)
        scales = (
            {"w13_scale": self.w13_scale, "w2_scale": self.w2_scale, "group_n": self.group_n}
            if self.quant
            else {}
        )
        fused = FUSED_MOE.choose(x, self.w13, self.w2, weights, ids, self.act, **scales)
        if fused is not None:  # sorted tokens + one grouped Triton GEMM per projection, no host sync
            if (
                self.ctx.expert_parallel
            ):  # the kernel takes real expert ids: other ranks' routes weigh zero here
                weights, ids = weights * (ids >= 0), ids.clamp(min=0)
            fuse_add = add is not None and not self.ctx.distributed  # else `add` joins after the all-reduce
            out = fused(x, self.w13, self.w2, weights, ids, self.act, add=add if fuse_add else None, **scales)
            if fuse_add:
                return out
        else:
            out = experts_reference(x, self.w13, self.w2, weights, ids, self.act, **scales)
        out = self.ctx.all_reduce(out)
        return out if add is None else out + add


def experts_reference(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    act: Callable[[torch.Tensor], torch.Tensor],
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    group_n: int = 128,
    quantize_activations: bool = False,
) -> torch.Tensor:
    """Tokens sorted by expert, one GEMM pair per expert that was hit; routes with id -1 (another rank's expert)
    are skipped. With scales, w13 and w2 are block FP8, each expert dequantized as it is hit. quantize_activations:
    each GEMM's input first goes through per-token-group FP8 (x per token, the gated activations per pair), what
    the W8A8 experts compute."""
    if quantize_activations:
        x = fake_quantize_per_token_group(x)
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32, device=x.device)
    num_experts = w13.shape[0]
    flat_ids = torch.where(
        ids >= 0, ids, num_experts
    ).flatten()  # skipped routes sort last, past every expert
    order = flat_ids.argsort(stable=True)
    counts = torch.bincount(flat_ids, minlength=num_experts + 1)[:num_experts].tolist()
    token_of = order // ids.shape[1]
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        sel = order[start : start + count]
        tokens = token_of[start : start + count]
        w_in, w_out = w13[expert], w2[expert]
        if w13_scale is not None:
            w_in = dequantize(w_in, w13_scale[expert], group_n).to(x.dtype)
            w_out = dequantize(w_out, w2_scale[expert], group_n).to(x.dtype)
        gate, up = F.linear(x[tokens], w_in).chunk(2, dim=-1)
        hidden = act(gate) * up
        y = F.linear(fake_quantize_per_token_group(hidden) if quantize_activations else hidden, w_out)
        out.index_add_(0, tokens, y.float() * weights.flatten()[sel, None])
        start += count
    return out.to(x.dtype)
