"""Linear layers that know how to take their slice of a checkpoint tensor.

Every parameter carries a `weight_loader(param, loaded, shard_id)` and the set of shard ids it expects, so the
weight loader can report missing shards and tensor parallelism only changes `ParallelContext`, not the models.
"""

from collections.abc import Hashable

import torch
import torch.nn.functional as F
from torch import nn

from mlaserve.kernels.registry import SKINNY_LINEAR
from mlaserve.layers import cpu_gemm
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
    """y = x W^T (+ b) on the local slice; subclasses decide which dimension is split."""

    def __init__(
        self, in_local: int, out_local: int, bias: bool, ctx: ParallelContext, shards=frozenset({None})
    ):
        super().__init__()
        self.ctx = ctx
        self.in_features, self.out_features = in_local, out_local
        self.weight = make_param(out_local, in_local, loader=self.weight_loader, shards=shards)
        self.bias = make_param(out_local, loader=self.weight_loader, shards=shards) if bias else None
        self.packed: torch.Tensor | None = None  # cpu_gemm's copy of the weight, set once weights are final

    def pack_weights(self) -> None:
        """Called once weights are final (after loading and process_weights_after_loading); idempotent."""
        if self.packed is not None:  # already packed: the original weight is gone
            return
        self.packed = cpu_gemm.pack(self.weight)
        if self.packed is not None:
            # The packed copy is the weight from now on; keeping the original would hold every weight twice.
            self.weight.data = self.weight.data.new_empty(0)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.packed is not None:
            return cpu_gemm.packed_linear(x, self.packed, bias)
        kernel = SKINNY_LINEAR.choose(x, self.weight, bias)  # a decode step's few 16-bit rows on CUDA
        if kernel is not None:
            return kernel(x, self.weight, bias)
        return F.linear(x, self.weight, bias)

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: Hashable = None) -> None:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)


class ReplicatedLinear(LinearBase):
    def __init__(
        self, in_features: int, out_features: int, bias: bool = False, ctx: ParallelContext = SINGLE
    ):
        super().__init__(in_features, out_features, bias, ctx)

    @slice_aware
    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: Hashable = None) -> None:
        default_weight_loader(param, loaded)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; no communication in forward."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool = False, ctx: ParallelContext = SINGLE
    ):
        super().__init__(in_features, ctx.shard(out_features, "output features"), bias, ctx)

    @slice_aware
    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: Hashable = None) -> None:
        n = param.shape[0]
        loaded = (
            loaded.narrow(0, self.ctx.tp_rank * n, n) if loaded.shape[0] == n * self.ctx.tp_size else loaded
        )
        default_weight_loader(param, loaded)


class MergedColumnParallelLinear(LinearBase):
    """Several column-parallel projections fused into one GEMM (gate+up); shard_id is the index."""

    def __init__(
        self, in_features: int, output_sizes: list[int], bias: bool = False, ctx: ParallelContext = SINGLE
    ):
        self.local_sizes = [ctx.shard(s, "output features") for s in output_sizes]
        super().__init__(in_features, sum(self.local_sizes), bias, ctx, frozenset(range(len(output_sizes))))

    @slice_aware
    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: Hashable = None) -> None:
        size = self.local_sizes[shard_id]
        offset = sum(self.local_sizes[:shard_id])
        if loaded.shape[0] == size * self.ctx.tp_size:
            loaded = loaded.narrow(0, self.ctx.tp_rank * size, size)
        default_weight_loader(param.data.narrow(0, offset, size), loaded)


class QKVParallelLinear(LinearBase):
    """Fused q/k/v projection for GQA; shard ids "q", "k", "v"."""

    def __init__(
        self,
        hidden: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool,
        ctx: ParallelContext = SINGLE,
    ):
        self.num_heads = ctx.shard(num_heads, "num_attention_heads")
        self.num_kv_heads = ctx.shard(num_kv_heads, "num_key_value_heads")
        q, kv = self.num_heads * head_dim, self.num_kv_heads * head_dim
        self.shard_offsets = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}
        super().__init__(hidden, q + 2 * kv, bias, ctx, frozenset({"q", "k", "v"}))

    @slice_aware
    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: Hashable = None) -> None:
        offset, size = self.shard_offsets[shard_id]
        if loaded.shape[0] == size * self.ctx.tp_size:
            loaded = loaded.narrow(0, self.ctx.tp_rank * size, size)
        default_weight_loader(param.data.narrow(0, offset, size), loaded)


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial sums are all-reduced, the bias added once after."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool = False, ctx: ParallelContext = SINGLE
    ):
        super().__init__(ctx.shard(in_features, "input features"), out_features, bias, ctx)

    @slice_aware
    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: Hashable = None) -> None:
        if param.dim() == 2:
            n = param.shape[1]
            loaded = (
                loaded.narrow(1, self.ctx.tp_rank * n, n)
                if loaded.shape[1] == n * self.ctx.tp_size
                else loaded
            )
        default_weight_loader(param, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.ctx.all_reduce(self.matmul(x, None))
        return y if self.bias is None else y + self.bias
