"""Tensor-parallel layout, passed explicitly to every sharded layer (no global process-group state)."""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ParallelContext:
    tp_rank: int = 0
    tp_size: int = 1
    group: object = None  # a torch.distributed ProcessGroup when tp_size > 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return x
        import torch.distributed as dist

        dist.all_reduce(x, group=self.group)
        return x

    def shard(self, total: int, what: str) -> int:
        if total % self.tp_size:
            raise ValueError(f"{what}={total} is not divisible by tensor_parallel_size={self.tp_size}")
        return total // self.tp_size


SINGLE = ParallelContext()
