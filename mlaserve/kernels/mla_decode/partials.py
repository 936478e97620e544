"""The partial outputs of split-KV decode and their merge, shared by every split step (triton_split.py and the Gluon
kernels): `split_step` lays out what a call's programs write, one partial output and base-2 LSE per (sequence,
head, split), or per (program, sequence) pair with balanced spans; `merge` combines them by their log-sum-exp into
the call's output and natural-log LSE, which callers may merge further (chunked context, sparse attention).
"""

import dataclasses

import torch
import triton
import triton.language as tl

from mlaserve.kernels.mla_decode.rules import DecodePlan
from mlaserve.kernels.mla_decode.spans import sequence_programs
from mlaserve.kernels.pdl import pdl_enter, pdl_launch

LOG2E = 1.4426950408889634


@triton.jit
def tile_mask(rows_ok, cols, D: tl.constexpr, TILE: tl.constexpr):
    """The load/store mask of a [rows, TILE] tile: rows_ok, and where TILE pads the width D, the columns below D."""
    if TILE == D:
        return rows_ok[:, None]
    else:
        return rows_ok[:, None] & (cols < D)[None, :]


@triton.jit(do_not_specialize=["stride_mlh", "num_splits", "batch"])
def _stage2(
    MidO, MidLse, Out, Lse, SeqLens,
    stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh, stride_ob, stride_oh, stride_lb,
    num_splits, batch,
    D_LAT: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr, LAT_TILE: tl.constexpr,
    BALANCED: tl.constexpr, BLOCK_N: tl.constexpr, MIN_TILES: tl.constexpr,
):  # fmt: skip
    # Launched early behind the split step (pdl.py): wait until that grid has finished and its partials are visible.
    pdl_enter(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, LAT_TILE)
    if BALANCED:
        # Sequence b's partials are rows b + c of the programs c whose spans touch it (_stage1), in blocks of
        # BLOCK_S, merged online.
        first, count = sequence_programs(SeqLens, batch, b, num_splits, BLOCK_N, MIN_TILES)
        top = tl.max(tl.full([BLOCK_S], float("-inf"), tl.float32), 0)
        total = tl.sum(tl.zeros([BLOCK_S], tl.float32), 0)
        out = tl.zeros([LAT_TILE], tl.float32)
        for j in range(0, count, BLOCK_S):
            ok = j + s < count
            row = b + first + j + s
            lse2 = tl.load(MidLse + row * stride_mlb + h * stride_mlh, mask=ok, other=float("-inf"))
            new_top = tl.maximum(top, tl.max(lse2, 0))  # finite: every stored partial has rows
            alpha = tl.exp2(top - new_top)
            w = tl.where(ok, tl.exp2(lse2 - new_top), 0.0)
            parts = tl.load(
                MidO + row[:, None] * stride_mob + h * stride_moh + d[None, :],
                mask=tile_mask(ok, d, D_LAT, LAT_TILE),
                other=0.0,
            ).to(tl.float32)
            out = out * alpha + tl.sum(parts * w[:, None], 0)
            total = total * alpha + tl.sum(w, 0)
            top = new_top
        out = out / tl.where(total > 0, total, 1.0)
    else:
        s_ok = s < num_splits
        lse2 = tl.load(MidLse + b * stride_mlb + h * stride_mlh + s, mask=s_ok, other=float("-inf"))
        top = tl.max(lse2, 0)
        w = tl.where(s_ok, tl.exp2(lse2 - top), 0.0)
        total = tl.sum(w, 0)
        # Splits past a sequence's share are empty (LSE -inf) and may not have written their partial output.
        parts = tl.load(
            MidO + b * stride_mob + h * stride_moh + s[:, None] * stride_mos + d[None, :],
            mask=tile_mask(s_ok & (lse2 > float("-inf")), d, D_LAT, LAT_TILE),
            other=0.0,
        ).to(tl.float32)
        out = tl.sum(parts * (w / total)[:, None], 0)
    if LAT_TILE == D_LAT:
        tl.store(Out + b * stride_ob + h * stride_oh + d, out.to(Out.dtype.element_ty))
    else:
        tl.store(Out + b * stride_ob + h * stride_oh + d, out.to(Out.dtype.element_ty), mask=d < D_LAT)
    tl.store(Lse + b * stride_lb + h, (top + tl.log2(total)) / 1.4426950408889634)


@dataclasses.dataclass(frozen=True, slots=True)
class SplitStep:
    """What a call's split step writes and is launched with: the cache as rows, the partial outputs and LSEs, the
    strides and sizes every split kernel takes after its queries, and the grid."""

    kv: torch.Tensor  # [blocks x page, row width]
    tensors: tuple[torch.Tensor, ...]  # kv, block_table, seq_lens, partial outputs, partial LSEs
    strides: tuple[int, ...]
    sizes: tuple[int | float, ...]  # heads, scale x log2(e), the grid's splits, the splits a sequence targets
    grid: tuple[int, int, int]

    @property
    def mid_o(self) -> torch.Tensor:
        return self.tensors[3]

    @property
    def mid_lse(self) -> torch.Tensor:
        return self.tensors[4]

    def args(self, q: torch.Tensor, q_pe: torch.Tensor) -> tuple:
        """The split kernels' arguments for 16-bit queries q and q_pe: queries, tensors, strides, sizes."""
        q_strides = (q.stride(0), q.stride(1), q_pe.stride(0), q_pe.stride(1))
        return (q, q_pe, *self.tensors, *q_strides, *self.strides, *self.sizes)


def split_step(
    plan: DecodePlan,
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_lora_rank: int,
    scale: float,
) -> SplitStep:
    """The partials `plan` writes over q [B, H, kv_lora_rank] and kv_cache, and its grid."""
    batch, heads, _ = q.shape
    num_splits = plan.num_splits
    row = kv_cache.shape[-1]  # width, or width + a 16-byte scale tail for 8-bit rows
    # Balanced spans keep one partial row per (program, sequence) pair it touches (triton_split): batch + programs
    rows, parts = (batch + num_splits, 1) if plan.balanced else (batch, num_splits)
    mid_o = torch.empty(rows, heads, parts, kv_lora_rank, dtype=plan.partial_dtype, device=q.device)
    mid_lse = torch.empty(rows, heads, parts, dtype=torch.float32, device=q.device)
    kv = kv_cache.view(-1, row)
    strides = (kv.stride(0), block_table.stride(0), mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
               mid_lse.stride(0), mid_lse.stride(1))  # fmt: skip
    sizes = (heads, scale * LOG2E, num_splits, plan.split_target or num_splits)
    groups = triton.cdiv(heads, plan.block_h)
    grid = (num_splits, groups, 1) if plan.balanced else (batch, groups, num_splits)
    return SplitStep(kv, (kv, block_table, seq_lens, mid_o, mid_lse), strides, sizes, grid)


def min_tiles(plan: DecodePlan) -> int:
    """The fewest tiles a balanced span takes."""
    return max(1, plan.min_span_rows // plan.block_n)


def merge(
    plan: DecodePlan, step: SplitStep, q: torch.Tensor, seq_lens: torch.Tensor, kv_lora_rank: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The call's output [B, H, kv_lora_rank] in q's dtype and LSE [B, H] (natural log) from the step's partials."""
    batch, heads, _ = q.shape
    num_splits = plan.num_splits
    mid_o, mid_lse = step.mid_o, step.mid_lse
    out = torch.empty(batch, heads, kv_lora_rank, dtype=q.dtype, device=q.device)
    lse = torch.empty(batch, heads, dtype=torch.float32, device=q.device)
    # The fp8-dot kernel's plan may ask for PDL on its own (its tuning); every kernel takes it where pdl.py does.
    merge_pdl = plan.pdl or pdl_launch(q)["PDL"]
    # Balanced spans merge a sequence's partials 8 at a time (most have 1-3): blocks of 32 were slower.
    _stage2[(batch, heads)](
        mid_o, mid_lse, out, lse, seq_lens,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1), lse.stride(0), num_splits, batch,
        D_LAT=kv_lora_rank, BLOCK_S=8 if plan.balanced else triton.next_power_of_2(num_splits), PDL=merge_pdl,
        LAT_TILE=plan.lat_tile or kv_lora_rank, BALANCED=plan.balanced, BLOCK_N=plan.block_n,
        MIN_TILES=min_tiles(plan), **({"launch_pdl": True} if merge_pdl else {}),
    )  # fmt: skip
    return out, lse
