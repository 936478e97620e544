"""DeepSeek-V4's routed experts in MXFP4 (layers/mxfp4.py), loaded as stored: packed bytes and e8m0 scales.

w13: [E, 2I, hidden / 2] (w1, the gate, rows then w3, the up projection), w2: [E, hidden, I / 2], each with its
scales [..., width / 32]. Every expert's three checkpoint tensors arrive apart (experts.N.w1 / w2 / w3, each with
its `.scale`); each lands in its rows, so a missing one is reported by name (expected_shards).

Compute: on a GPU, a weight-only grouped GEMM that reads the packed bytes and scales (kernels/moe/mxfp4_gemm.py);
elsewhere each expert the step routes to is dequantized as it runs (experts_reference, the kernel's reference).
Either way the weights stay at half a byte per value in memory.

Over tensor-parallel ranks without expert parallelism each rank holds a slice of every expert's width I: its
I / size rows of w1 and of w3, and the same I / size input columns of w2, which in w2's packed bytes are I / size / 2
bytes and in its scales I / size / 32 groups per row. A slice must therefore be whole scale groups (layout_problems
refuses the sizes that would cut one). Each rank's output is a partial sum that the MoE layer all-reduces.
"""

from collections.abc import Hashable

import torch
import torch.nn.functional as F
from torch import nn

from mlaserve.kernels.registry import MXFP4_MOE
from mlaserve.layers.mxfp4 import GROUP, as_bytes, dequantize
from mlaserve.loader.checkpoint_slice import CheckpointSlice, ShapeMismatch, read, slice_aware
from mlaserve.parallel import SINGLE, ParallelContext
from mlaserve.parallel.layout import mxfp4_width_problem

Loaded = torch.Tensor | CheckpointSlice  # a checkpoint tensor, read or not yet

# How checkpoints type the packed bytes and the scales (only the bits are read)
PACKED_DTYPES = tuple(
    d for d in (torch.int8, torch.uint8, getattr(torch, "float4_e2m1fn_x2", None)) if d is not None
)
SCALE_DTYPES = tuple(d for d in (torch.uint8, getattr(torch, "float8_e8m0fnu", None)) if d is not None)


def swiglu_limited(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """V4's SwiGLU: the gate clamped from above, the up projection on both sides."""
    return F.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)


def experts_reference(
    x: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    limit: float,
    every_expert: bool = False,
) -> torch.Tensor:
    """The routed experts' weighted sum per token; each expert dequantized to x's dtype as it is used.
    every_expert: run all experts over all tokens (weight 0 where not routed) without asking the device which
    were picked, as a captured step must."""
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32, device=x.device)
    experts = range(w13.shape[0]) if every_expert else ids.unique().tolist()
    for e in experts:
        if every_expert:
            tokens, weight = slice(None), (weights * (ids == e)).sum(dim=-1, keepdim=True)
        else:
            token, slot = torch.where(ids == e)
            tokens, weight = token, weights[token, slot, None]
        w_in = dequantize(w13[e], w13_scale[e]).to(x.dtype)
        gate, up = F.linear(x[tokens], w_in).chunk(2, dim=-1)
        y = F.linear(swiglu_limited(gate, up, limit), dequantize(w2[e], w2_scale[e]).to(x.dtype))
        if every_expert:
            out += y.float() * weight
        else:
            out.index_add_(0, tokens, y.float() * weight)
    return out.to(x.dtype)


def _byte_param(*shape: int, loader, shards: frozenset, kind: str) -> nn.Parameter:
    param = nn.Parameter(torch.zeros(*shape, dtype=torch.uint8), requires_grad=False)
    param.weight_loader = loader
    param.expected_shards = shards
    param.bytes_kind = kind  # how weight accounting names these bytes (loader/weights.py)
    return param


class MXFP4Experts(nn.Module):
    """ctx: the ranks that split every expert's width (SINGLE: whole experts, as under expert parallelism)."""

    def __init__(
        self, num_experts: int, hidden: int, intermediate: int, limit: float, ctx: ParallelContext = SINGLE
    ) -> None:
        super().__init__()
        for width, what in ((hidden, "hidden_size"), (intermediate, "moe_intermediate_size")):
            if width % GROUP:
                raise ValueError(
                    f"MXFP4 experts need {what} to be a multiple of {GROUP} (one scale per {GROUP} inputs), "
                    f"got {width}"
                )
        if (problem := mxfp4_width_problem(intermediate, ctx.tp_size)) is not None:
            raise ValueError(problem)
        self.rank, self.ranks = ctx.tp_rank, ctx.tp_size
        self.hidden, self.inter, self.limit = hidden, intermediate // ctx.tp_size, limit
        w13_shards = frozenset((e, i) for e in range(num_experts) for i in (0, 1))
        w2_shards = frozenset(range(num_experts))
        e, h, i = num_experts, hidden, self.inter
        self.w13 = _byte_param(e, 2 * i, h // 2, loader=self.load, shards=w13_shards, kind="mxfp4")
        self.w13_scale = _byte_param(
            e, 2 * i, h // GROUP, loader=self.load, shards=w13_shards, kind="mxfp4 scales"
        )
        self.w2 = _byte_param(e, h, i // 2, loader=self.load, shards=w2_shards, kind="mxfp4")
        self.w2_scale = _byte_param(e, h, i // GROUP, loader=self.load, shards=w2_shards, kind="mxfp4 scales")

    def rank_part(self, loaded: Loaded, for_w2: bool, per_byte: int) -> Loaded:
        """This rank's slice of a checkpoint tensor that holds every rank's width: rows of w1 / w3, input columns
        of w2. per_byte: how many of the width's values one stored element covers (2 packed, 32 a scale)."""
        dim = 1 if for_w2 else 0
        part = self.inter // per_byte
        if self.ranks == 1 or len(loaded.shape) <= dim or loaded.shape[dim] != part * self.ranks:
            return loaded  # a shape that is not the full width is refused by the shape check
        return loaded.narrow(dim, self.rank * part, part)

    @slice_aware
    def load(self, param: torch.Tensor, loaded: Loaded, shard_id: Hashable) -> None:
        """shard_id: (expert, 0 for w1 / 1 for w3) for w13 and its scales, the expert for w2 and its scales."""
        expert, which = shard_id if isinstance(shard_id, tuple) else (shard_id, None)
        if not 0 <= expert < param.shape[0]:
            raise ShapeMismatch(f"expert {expert}: the model has {param.shape[0]} routed experts")
        target = param.data[expert]
        if which is not None:
            target = target.narrow(0, which * self.inter, self.inter)
        is_scale = param is self.w13_scale or param is self.w2_scale
        is_w2 = param is self.w2 or param is self.w2_scale
        # w1 / w3 split by rows (each row whole); w2 by input columns, stored GROUP to a scale and 2 to a byte
        loaded = self.rank_part(loaded, is_w2, (GROUP if is_scale else 2) if is_w2 else 1)
        what = "e8m0 scales" if is_scale else "packed FP4 weight (two values per byte)"
        if tuple(loaded.shape) != tuple(target.shape):
            raise ShapeMismatch(
                f"{what}: checkpoint shape {tuple(loaded.shape)}, expected {tuple(target.shape)}"
            )
        tensor = read(loaded)
        allowed = SCALE_DTYPES if is_scale else PACKED_DTYPES
        if tensor.dtype not in allowed:
            names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
            raise ShapeMismatch(f"{what}: checkpoint dtype {tensor.dtype}; expected one of {names}")
        target.copy_(as_bytes(tensor))

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        args = (x, self.w13, self.w13_scale, self.w2, self.w2_scale, ids, weights, self.limit)
        kernel = MXFP4_MOE.choose(*args)  # the GPU's weight-only grouped GEMM over the packed bytes
        if kernel is not None:
            return kernel(*args)
        every = x.is_cuda and torch.cuda.is_current_stream_capturing()
        return experts_reference(*args, every_expert=every)
