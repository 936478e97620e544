"""DeepSeek-V4's projections and feed-forward: the grouped output projection, the SwiGLU experts, the hash- or
score-routed MoE; torch reference.

With a block-FP8 checkpoint (DeepSeek-V4-Flash as published) the projections DeepSeek stores in FP8 (the attention's
wq_a, wq_b, wkv, wo_a, wo_b, the indexer's wq_b, the shared expert) take the engine's FP8 linear layers, and the
routed experts its MXFP4 experts where the config says expert_dtype "fp4". The compressors' wkv / wgate, the
indexer's weights_proj and the router stay in the model's dtype: the checkpoint ships them unquantized.

Over tensor-parallel ranks the experts are split by width (each rank a slice of every expert's w1/w3 rows and w2
columns) or, with expert parallelism, whole (a run of experts per rank); the shared expert is split by width either
way. Every rank's routed and shared outputs are partial sums of the same tokens, so one all-reduce per MoE layer
joins them all, not one per expert.
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from mlaserve.config.quantization import BlockFP8Config
from mlaserve.kernels.registry import BLOCK_FP8_LINEAR
from mlaserve.layers.linear import ColumnParallelLinear, LinearBase, ReplicatedLinear, RowParallelLinear
from mlaserve.layers.mxfp4_experts import MXFP4Experts, swiglu_limited
from mlaserve.parallel import SINGLE, ParallelContext


def v4_linear(
    in_features: int,
    out_features: int,
    quant: BlockFP8Config | None,
    ctx: ParallelContext = SINGLE,
    split: str | None = None,
) -> nn.Module:
    """A bias-free projection: block FP8 where the checkpoint quantizes it, else a plain linear layer. Over ranks,
    split "column" (this rank's output rows) or "row" (its input columns; forward all-reduces, matmul does not)."""
    if ctx.tp_size > 1 and split == "column":
        return ColumnParallelLinear(in_features, out_features, ctx=ctx, quant=quant)
    if ctx.tp_size > 1 and split == "row":
        return RowParallelLinear(in_features, out_features, ctx=ctx, quant=quant)
    if quant is None:
        return nn.Linear(in_features, out_features, bias=False)
    return ReplicatedLinear(in_features, out_features, quant=quant)


class GroupedLinear(LinearBase):
    """wo_a: each of n_groups groups of heads projected on its own to out_features / n_groups. A block-FP8 weight
    runs as one block-FP8 GEMM per group where the engine has that kernel and the groups hold whole scale blocks;
    elsewhere (the CPU, the torch reference) it is dequantized as the step runs and the groups are one batched
    GEMM. Over ranks, each holds the groups of its own heads (heads are numbered group by group), i.e. its share of
    the output rows."""

    splits_rows = True

    def __init__(
        self,
        in_per_group: int,
        out_features: int,
        n_groups: int,
        quant: BlockFP8Config | None = None,
        ctx: ParallelContext = SINGLE,
    ) -> None:
        super().__init__(
            in_per_group, ctx.shard(out_features, "o_groups x o_lora_rank"), False, ctx, quant=quant
        )
        self.n_groups = ctx.shard(n_groups, "o_groups")

    def pack_weights(self) -> None:
        """The batched GEMM reads the weight itself: no packed copy."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, n_groups, in_per_group] -> [T, out_features]"""
        if self.quant and (groups := self._fp8_groups(x)) is not None:
            kernel, rows = groups
            scale_rows, pow2 = rows // self.group_n, self.quant.pow2_scales
            return torch.cat(
                [
                    kernel(
                        x[:, g],
                        self.weight[g * rows : (g + 1) * rows],
                        self.weight_scale_inv[g * scale_rows : (g + 1) * scale_rows],
                        self.group_n,
                        None,
                        pow2_scale=pow2,
                    )
                    for g in range(self.n_groups)
                ],
                dim=1,
            )
        weight = self.dequantized_weight(x.dtype)
        w = weight.view(self.n_groups, -1, weight.shape[-1]).transpose(1, 2)
        return torch.bmm(x.transpose(0, 1), w).transpose(0, 1).flatten(1)

    def _fp8_groups(self, x: torch.Tensor) -> tuple[Callable, int] | None:
        """The block-FP8 kernel for one group's GEMM and the group's weight rows, where each group's rows are
        whole scale blocks and the engine runs that kernel for x; else None."""
        rows = self.out_features // self.n_groups
        if rows % self.group_n:
            return None
        scale = self.weight_scale_inv[: rows // self.group_n]
        kernel = BLOCK_FP8_LINEAR.choose(x[:, 0], self.weight[:rows], scale, self.group_n, None)
        return (kernel, rows) if kernel is not None else None


class V4MLP(nn.Module):
    """SwiGLU (w1 gate, w3 up, w2 down: DeepSeek's names) with the gate clamped from above and the up projection on
    both sides (swiglu_limit)."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        limit: float,
        quant: BlockFP8Config | None = None,
        ctx: ParallelContext = SINGLE,
    ) -> None:
        super().__init__()
        self.limit = limit
        self.w1 = v4_linear(hidden_size, intermediate_size, quant, ctx, "column")
        self.w3 = v4_linear(hidden_size, intermediate_size, quant, ctx, "column")
        self.w2 = v4_linear(intermediate_size, hidden_size, quant, ctx, "row")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Split over ranks: this rank's partial sum (V4MoE all-reduces the layer's sum once)."""
        h = swiglu_limited(self.w1(x), self.w3(x), self.limit)
        return self.w2.matmul(h, None) if isinstance(self.w2, RowParallelLinear) else self.w2(h)


def run_experts(
    experts: nn.ModuleList, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """Each routed expert over its tokens (a reference loop), weighted and summed per token."""
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        return run_every_expert(experts, x, ids, weights)
    out = torch.zeros_like(x)
    for expert in ids.unique().tolist():
        if expert < 0:  # another rank's (expert parallelism)
            continue
        token, slot = torch.where(ids == expert)
        out.index_add_(0, token, (experts[expert](x[token]) * weights[token, slot, None]).to(x.dtype))
    return out


def run_every_expert(
    experts: nn.ModuleList, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """run_experts without asking the device which experts were picked, as a captured decode step must: every
    expert over every token, weighted 0 where it was not routed (a small batch's cost, not a large one's)."""
    out = torch.zeros_like(x, dtype=torch.float32)
    for e, expert in enumerate(experts):
        weight = (weights * (ids == e)).sum(dim=-1, keepdim=True)
        out += expert(x).float() * weight
    return out.to(x.dtype)


class V4Router(nn.Module):
    """Experts by score plus a correction bias or, in hash layers, by a fixed token-id table; the chosen experts'
    scores, normalised, weight them."""

    def __init__(self, cfg: object, hashed: bool) -> None:
        super().__init__()
        self.top_k, self.scoring, self.factor = (
            cfg.num_experts_per_tok,
            cfg.scoring_func,
            cfg.routed_scaling_factor,
        )
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size))
        if hashed:
            # a checkpoint's table replaces this; a dummy model spreads token ids over the experts
            table = torch.arange(cfg.vocab_size * self.top_k).view(-1, self.top_k) % cfg.n_routed_experts
            self.tid2eid = nn.Parameter(table, requires_grad=False)
        else:
            self.bias = nn.Parameter(
                torch.zeros(cfg.n_routed_experts, dtype=torch.float32)
            )  # score correction

    def scores(self, logits: torch.Tensor) -> torch.Tensor:
        if self.scoring == "sqrtsoftplus":
            return F.softplus(logits).sqrt()
        if self.scoring == "sigmoid":
            return logits.sigmoid()
        return logits.softmax(dim=-1)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = self.scores(F.linear(x, self.weight))
        if hasattr(self, "tid2eid"):
            ids = self.tid2eid[input_ids].long()
        else:
            ids = torch.topk(scores + self.bias, self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
        return weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * self.factor, ids


def local_experts(n_routed: int, ctx: ParallelContext) -> range:
    """The experts this rank holds: all of them, or its run of whole experts under expert parallelism."""
    if not ctx.expert_parallel:
        return range(n_routed)
    count = ctx.shard(n_routed, "n_routed_experts")
    return range(ctx.tp_rank * count, (ctx.tp_rank + 1) * count)


class V4MoE(nn.Module):
    def __init__(
        self, cfg: object, hashed: bool, quant: BlockFP8Config | None = None, ctx: ParallelContext = SINGLE
    ) -> None:
        super().__init__()
        self.ctx = ctx
        self.gate = V4Router(cfg, hashed)
        mlp = (cfg.hidden_size, cfg.moe_intermediate_size, cfg.swiglu_limit)
        self.local = local_experts(cfg.n_routed_experts, ctx)
        # by width over the ranks, or whole (a rank's own run) under expert parallelism
        expert_ctx = SINGLE if ctx.expert_parallel else ctx
        self.experts: nn.Module
        if quant is not None and quant.expert_dtype == "fp4":
            self.experts = MXFP4Experts(len(self.local), *mlp, expert_ctx)
        else:
            self.experts = nn.ModuleList(V4MLP(*mlp, quant, expert_ctx) for _ in self.local)
        self.shared_experts = V4MLP(*mlp, quant, ctx)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x, input_ids)
        if self.ctx.expert_parallel:  # this rank's experts only: the others' routes weigh nothing here
            mine = (ids >= self.local.start) & (ids < self.local.stop)
            weights = weights * mine
            ids = torch.where(mine, ids - self.local.start, -1)
        if isinstance(self.experts, MXFP4Experts):
            routed = self.experts(x, ids.clamp(min=0), weights)  # another rank's route: weight 0
        else:
            routed = run_experts(self.experts, x, ids, weights)
        return self.ctx.all_reduce(routed + self.shared_experts(x))
