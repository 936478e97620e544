"""Weights packed once for oneDNN, the fast path for linear layers on CPU.

F.linear on CPU goes to MKL's sgemm, which re-packs the weight matrix on every call. At decode's row counts
(one row per running sequence) that packing can cost as much as the multiply, most of all for wide
weights such as an LM head. The weights do not change after loading, so they are reordered
into oneDNN's blocked layout once; F.linear stays as the reference. Linear layers drop their original weight
once packed (memory holds each weight once); the LM head keeps its own, which is usually the tied embedding
table.

Only float32 is packed: bf16 on CPUs without AVX-512 BF16 is emulated and slower than the plain path.
"""

import torch

ROWS_HINT = 16  # oneDNN picks its blocking for this many rows; any row count works with the result
# oneDNN builds (and caches) a primitive per row count, and memory grew with every new count: serving prompts of
# every length, a server's resident memory rose by ~25 MB per 150 requests on a tiny model and plateaued only near
# 1 GB. Longer inputs run in slices of at most this many rows, so at most this many counts exist per weight
# shape and memory levels off after warm-up (benchmarks/soak.py); a slice of 64 rows is a full-size GEMM.
MAX_ROWS = 64


def can_pack(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and weight.dim() == 2
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


def pack(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight reordered for packed_linear, or None where this build or device cannot."""
    if not can_pack(weight):
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), ROWS_HINT)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for the weight that `pack` reordered; x may have any leading dims."""
    lead = x.shape[:-1]
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] <= MAX_ROWS:
        y = torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")
    else:
        y = torch.cat(
            [
                torch.ops.mkldnn._linear_pointwise(rows[i : i + MAX_ROWS], packed, bias, "none", [], "")
                for i in range(0, rows.shape[0], MAX_ROWS)
            ]
        )
    return y.reshape(*lead, y.shape[-1])
