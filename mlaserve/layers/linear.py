"""Linear layers that know how to take their slice of a checkpoint tensor.

Every parameter carries a `weight_loader(param, loaded, shard_id)` and the set of shard ids it expects, so the
weight loader can report missing shards and tensor parallelism only changes `ParallelContext`, not the models.
"""

from collections.abc import Hashable

import torch
import torch.nn.functional as F
from torch import nn

from mlaserve.config.quantization import BlockFP8Config
from mlaserve.kernels.registry import BLOCK_FP8_LINEAR, SKINNY_LINEAR
from mlaserve.layers import cpu_gemm
from mlaserve.layers.block_fp8 import FP8, dequantize, linear_reference
from mlaserve.layers.fp8_params import (
    Part,
    check_column_split,
    group_rows,
    scale_param,
    store_scale,
    store_weight,
)
from mlaserve.loader.checkpoint_slice import (
    default_weight_loader,
    slice_aware,
)
from mlaserve.parallel import SINGLE, ParallelContext


def make_param(
    *shape: int,
    loader=default_weight_loader,
    shards: frozenset = frozenset({None}),
    dtype: torch.dtype | None = None,
) -> nn.Parameter:
    param = nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
    param.weight_loader = loader
    param.expected_shards = shards
    return param


class LinearBase(nn.Module):
    """y = x W^T (+ b) on the local slice; subclasses say which rows of which checkpoint tensor each part of the
    weight takes (`part`), and whether the input columns are split over ranks (`col_ranks`).

    quant: the weight is block FP8 (layers/fp8_params.py) with its scales in `weight_scale_inv`."""

    splits_rows = False  # column-parallel: each rank holds its part of the output rows
    splits_columns = False  # row-parallel: each rank holds its part of the input columns

    def __init__(
        self,
        in_local: int,
        out_local: int,
        bias: bool,
        ctx: ParallelContext,
        shards=frozenset({None}),
        quant: BlockFP8Config | None = None,
        part_rows: list[int] | None = None,
    ):
        super().__init__()
        self.ctx = ctx
        self.in_features, self.out_features = in_local, out_local
        self.quant = quant
        dtype = FP8 if quant else None
        self.weight = make_param(out_local, in_local, loader=self.weight_loader, shards=shards, dtype=dtype)
        self.bias = make_param(out_local, loader=self.weight_loader, shards=shards) if bias else None
        self.packed: torch.Tensor | None = None  # cpu_gemm's copy of the weight, set once weights are final
        if quant:
            self.group_n = group_rows(quant, part_rows or [out_local], self.row_ranks > 1)
            check_column_split(quant, in_local, self.col_ranks, type(self).__name__)
            self.weight_scale_inv = scale_param(
                (out_local,), in_local, self.group_n, self.scale_loader, shards
            )

    @property
    def row_ranks(self) -> int:
        return self.ctx.tp_size if self.splits_rows else 1

    @property
    def col_ranks(self) -> int:
        return self.ctx.tp_size if self.splits_columns else 1

    def part(self, shard_id: Hashable) -> tuple[int, int]:
        """(first row in the layer's weight, rows) of a checkpoint tensor's part."""
        return 0, self.out_features

    def _part(self, shard_id: Hashable) -> Part:
        """Where the part of shard_id lands, as taken from a checkpoint tensor that holds every rank's rows."""
        offset, size = self.part(shard_id)
        rank = self.ctx.tp_rank
        return Part(
            offset, size, rank * size * (self.row_ranks > 1), rank * self.in_features * (self.col_ranks > 1)
        )

    def pack_weights(self) -> None:
        """Called once weights are final (after loading and process_weights_after_loading); idempotent."""
        if self.packed is not None or self.quant:  # already packed (the original weight is gone), or FP8
            return
        self.packed = cpu_gemm.pack(self.weight)
        if self.packed is not None:
            # The packed copy is the weight from now on; keeping the original would hold every weight twice.
            self.weight.data = self.weight.data.new_empty(0)

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight as `dtype` (FP8 weights dequantized): for derived weights such as MLA's absorbed ones."""
        if not self.quant:
            return self.weight.detach().to(dtype)
        return dequantize(self.weight, self.weight_scale_inv, self.group_n).to(dtype)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.quant:
            scale, group_n = self.weight_scale_inv, self.group_n
            kernel = BLOCK_FP8_LINEAR.choose(x, self.weight, scale, group_n, bias)
            if kernel is not None:
                # ue8m0 checkpoints were trained with power-of-two activation scales
                return kernel(x, self.weight, scale, group_n, bias, pow2_scale=self.quant.pow2_scales)
            return linear_reference(x, self.weight, scale, group_n, bias)
        if self.packed is not None:
            return cpu_gemm.packed_linear(x, self.packed, bias)
        kernel = SKINNY_LINEAR.choose(x, self.weight, bias)  # a decode step's few 16-bit rows on CUDA
        if kernel is not None:
            return kernel(x, self.weight, bias)
        return F.linear(x, self.weight, bias)

    @slice_aware
    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: Hashable = None) -> None:
        part = self._part(shard_id)
        # a tensor of every rank's rows is narrowed to this rank's; any other is copied as is (or refused)
        if loaded.shape[0] == part.size * self.row_ranks:
            loaded = loaded.narrow(0, part.first, part.size)
        if param.dim() == 2 and loaded.shape[1] == self.in_features * self.col_ranks:
            loaded = loaded.narrow(1, part.col0, self.in_features)
        if param is self.weight and self.quant:
            scale = self.weight_scale_inv
            store_weight(param.data, scale, scale.data, loaded, part, self.group_n, shard_id)
            return
        default_weight_loader(param.data.narrow(0, part.offset, part.size), loaded)

    @slice_aware
    def scale_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: Hashable = None) -> None:
        part = self._part(shard_id)
        full = (part.size * self.row_ranks, self.in_features * self.col_ranks)
        store_scale(param.data, loaded, part, self.in_features, full, self.group_n, self.quant)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)


class ReplicatedLinear(LinearBase):
    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        ctx: ParallelContext = SINGLE,
        quant: BlockFP8Config | None = None,
    ):
        super().__init__(in_features, out_features, bias, ctx, quant=quant)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; no communication in forward."""

    splits_rows = True

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        ctx: ParallelContext = SINGLE,
        quant: BlockFP8Config | None = None,
    ):
        super().__init__(in_features, ctx.shard(out_features, "output features"), bias, ctx, quant=quant)

    @property
    def row_ranks(self) -> int:
        return self.ctx.tp_size


class MergedColumnParallelLinear(LinearBase):
    """Several column-parallel projections fused into one GEMM (gate+up); shard_id is the index."""

    splits_rows = True

    def __init__(
        self,
        in_features: int,
        output_sizes: list[int],
        bias: bool = False,
        ctx: ParallelContext = SINGLE,
        quant: BlockFP8Config | None = None,
    ):
        self.local_sizes = [ctx.shard(s, "output features") for s in output_sizes]
        shards = frozenset(range(len(output_sizes)))
        super().__init__(in_features, sum(self.local_sizes), bias, ctx, shards, quant, self.local_sizes)

    def part(self, shard_id: Hashable) -> tuple[int, int]:
        return sum(self.local_sizes[:shard_id]), self.local_sizes[shard_id]


class QKVParallelLinear(LinearBase):
    """Fused q/k/v projection for GQA; shard ids "q", "k", "v"."""

    splits_rows = True

    def __init__(
        self,
        hidden: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool,
        ctx: ParallelContext = SINGLE,
        quant: BlockFP8Config | None = None,
    ):
        self.num_heads = ctx.shard(num_heads, "num_attention_heads")
        self.num_kv_heads = ctx.shard(num_kv_heads, "num_key_value_heads")
        q, kv = self.num_heads * head_dim, self.num_kv_heads * head_dim
        self.shard_offsets = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}
        shards = frozenset({"q", "k", "v"})
        super().__init__(hidden, q + 2 * kv, bias, ctx, shards, quant, [q, kv, kv])

    def part(self, shard_id: Hashable) -> tuple[int, int]:
        return self.shard_offsets[shard_id]


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial sums are all-reduced, the bias added once after."""

    splits_columns = True

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        ctx: ParallelContext = SINGLE,
        quant: BlockFP8Config | None = None,
    ):
        super().__init__(ctx.shard(in_features, "input features"), out_features, bias, ctx, quant=quant)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.ctx.all_reduce(self.matmul(x, None))
        return y if self.bias is None else y + self.bias
