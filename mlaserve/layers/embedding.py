"""Token embedding and LM head, sharded over the vocabulary."""

import torch
import torch.nn.functional as F
from torch import nn

from mlaserve.kernels.registry import SKINNY_LINEAR
from mlaserve.layers import cpu_gemm
from mlaserve.layers.linear import make_param
from mlaserve.loader.checkpoint_slice import default_weight_loader, read, slice_aware
from mlaserve.parallel import SINGLE, ParallelContext


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden: int, ctx: ParallelContext = SINGLE) -> None:
        super().__init__()
        self.ctx = ctx
        self.vocab_size = vocab_size
        self.per_rank = (vocab_size + ctx.tp_size - 1) // ctx.tp_size
        self.start = ctx.tp_rank * self.per_rank
        self.weight = make_param(self.per_rank, hidden, loader=self.weight_loader)

    @slice_aware
    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: object = None) -> None:
        if loaded.shape[0] != self.vocab_size:
            raise ValueError(
                f"embedding rows: checkpoint {loaded.shape[0]}, expected vocab_size {self.vocab_size}"
            )
        rows = max(0, min(self.per_rank, self.vocab_size - self.start))
        part = loaded.narrow(0, min(self.start, self.vocab_size), rows)
        if rows < self.per_rank:  # the last rank's padding rows stay zero
            param.data.zero_()
            param.data[:rows].copy_(read(part))
        else:
            default_weight_loader(param, part)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not self.ctx.distributed:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        valid = (local >= 0) & (local < self.per_rank)
        out = F.embedding(local.clamp(0, self.per_rank - 1), self.weight) * valid.unsqueeze(-1)
        return self.ctx.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Projects hidden states to logits; with tied embeddings it shares the embedding's weight."""

    packed: torch.Tensor | None = None

    def pack_weights(self) -> None:
        self.packed = cpu_gemm.pack(self.weight)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        skinny = SKINNY_LINEAR.choose(hidden, self.weight) if self.packed is None else None
        if self.packed is not None:
            logits = cpu_gemm.packed_linear(hidden, self.packed)
        elif skinny is not None:  # a decode step's few rows on CUDA
            logits = skinny(hidden, self.weight)
        else:
            logits = F.linear(hidden, self.weight)
        return self.ctx.all_gather_last(logits)[..., : self.vocab_size]
