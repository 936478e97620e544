"""DeepSeek-V4 decode's work around the paged decode kernel, one Triton launch each (attention/v4_decode.py):

  entry_rows       each sequence's complete entries at a rate, and its own index (the indexer's table row)
  merge_with_sink  the parts' outputs weighted by their share of one softmax whose sum also holds exp(sink[h])

In torch each was a dozen or more small launches, which at decode sizes (a few microseconds each, replayed from a
CUDA graph) cost more than the window's attention itself. v4_decode.py keeps the torch forms as their reference.
"""

from typing import NamedTuple

import torch
import triton
import triton.language as tl


class EntryRows(NamedTuple):
    """entry_rows' outputs: counts [B] int32 (complete entries at the rate), rows [B] int32 (0 .. B - 1)."""

    counts: torch.Tensor
    rows: torch.Tensor


@triton.jit
def _entry_rows(SeqLens, Counts, Rows, batch, rate, BLOCK: tl.constexpr):
    b = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = b < batch
    tl.store(Counts + b, tl.load(SeqLens + b, mask=ok, other=0) // rate, mask=ok)
    tl.store(Rows + b, b, mask=ok)


def entry_rows(seq_lens: torch.Tensor, rate: int) -> EntryRows:
    """Each sequence's complete entries at `rate` and its index (its row of the entry group's tables), for
    seq_lens [B] int32."""
    b = seq_lens.shape[0]
    out = EntryRows(*(torch.empty(b, dtype=torch.int32, device=seq_lens.device) for _ in range(2)))
    if b:
        block = min(1024, triton.next_power_of_2(b))
        _entry_rows[(triton.cdiv(b, block),)](seq_lens, *out, b, rate, BLOCK=block)
    return out


@triton.jit
def _merge_with_sink(
    OutA, LseA, LensA, OutB, LseB, LensB, Sink, Out,
    stride_ab, stride_ah, stride_bb, stride_bh, stride_ob, stride_oh, stride_la, stride_lb, heads, dim,
    TWO: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    h = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < dim
    sink = tl.load(Sink + h).to(tl.float32)
    # a part with no keys adds nothing: the decode kernels leave its output and LSE undefined, so never multiply
    has_a = tl.load(LensA + b) > 0
    lse_a = tl.where(has_a, tl.load(LseA + b * stride_la + h), float("-inf"))
    top = tl.maximum(sink, lse_a)
    if TWO:
        has_b = tl.load(LensB + b) > 0
        lse_b = tl.where(has_b, tl.load(LseB + b * stride_lb + h), float("-inf"))
        top = tl.maximum(top, lse_b)
    w_a = tl.exp(lse_a - top)
    total = tl.exp(sink - top) + w_a
    out_a = tl.load(OutA + b * stride_ab + h * stride_ah + d, mask=d < tl.where(has_a, dim, 0), other=0.0).to(
        tl.float32
    )
    acc = out_a * w_a
    if TWO:
        w_b = tl.exp(lse_b - top)
        total += w_b
        out_b = tl.load(
            OutB + b * stride_bb + h * stride_bh + d, mask=d < tl.where(has_b, dim, 0), other=0.0
        ).to(tl.float32)
        acc += out_b * w_b
    tl.store(Out + b * stride_ob + h * stride_oh + d, (acc / total).to(Out.dtype.element_ty), mask=d_ok)


def merge_with_sink(
    parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], sink: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """[B, H, D] in dtype: one or two parts (out [B, H, D] with a unit last stride, lse [B, H] natural log, lens
    [B] the keys each saw) merged with sink [H] (any float dtype: read as float32, so a 16-bit model's sink needs
    no cast launch) as one softmax, in float32."""
    first, second = parts[0], parts[-1]
    if len(parts) > 2:
        raise ValueError(f"merge_with_sink takes one or two parts, got {len(parts)}")
    out_a, lse_a, lens_a = first
    out_b, lse_b, lens_b = second
    b, h, d = out_a.shape
    out = torch.empty(b, h, d, dtype=dtype, device=out_a.device)
    if b:
        _merge_with_sink[(b, h)](
            out_a, lse_a, lens_a, out_b, lse_b, lens_b, sink, out,
            out_a.stride(0), out_a.stride(1), out_b.stride(0), out_b.stride(1), out.stride(0), out.stride(1),
            lse_a.stride(0), lse_b.stride(0), h, d, TWO=len(parts) == 2, BLOCK_D=triton.next_power_of_2(d),
        )  # fmt: skip
    return out
