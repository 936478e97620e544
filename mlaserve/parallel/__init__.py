"""Tensor-parallel layout, passed explicitly to every sharded layer (no global process-group state).

Every rank runs the same layers over its slice of the weights; a layer that ends a split (row-parallel linear,
vocab-parallel embedding, the experts) joins the partial results with a collective on `group`. Without a process
group (tensor_parallel_size 1 in one process) those collectives are skipped; with one, they run whatever its size,
so a single GPU runs the multi-GPU code path (distributed_executor_backend="mp").
"""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ParallelContext:
    tp_rank: int = 0
    tp_size: int = 1
    group: object = None  # the ranks' torch.distributed group (NCCL on CUDA, gloo on CPU); None: one process
    # Control messages (each step's batch plan) go over gloo, on the host, whatever the data group is.
    cpu_group: object = None
    # MoE experts split across ranks (each rank holds whole experts) instead of each expert split across ranks.
    expert_parallel: bool = False

    @property
    def distributed(self) -> bool:
        return self.group is not None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.group is None:
            return x
        import torch.distributed as dist

        dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's x side by side along the last dimension (rank order)."""
        if self.group is None:
            return x
        import torch.distributed as dist

        parts = [torch.empty_like(x) for _ in range(self.tp_size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def shard(self, total: int, what: str) -> int:
        if total % self.tp_size:
            raise ValueError(f"{what}={total} is not divisible by tensor_parallel_size={self.tp_size}")
        return total // self.tp_size


SINGLE = ParallelContext()
