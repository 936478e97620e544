"""The tiled and grouped experts' last step: each token's top-k pair outputs summed (and weighed, where they come
in sorted order), plus an optional addend such as the shared experts' output, in one launch."""

import torch
import triton
import triton.language as tl

from mlaserve.kernels.pdl import pdl_enter, pdl_launch


@triton.jit
def _combine_kernel(
    Down, Add, Out, Pos, RouteW, hidden,
    TOP_K: tl.constexpr, HAS_ADD: tl.constexpr, GATHER: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < hidden
    acc = tl.zeros([BLOCK], tl.float32)
    for j in tl.static_range(TOP_K):
        if GATHER:  # the pair's row sits where the expert sort put it; its routing weight is applied here
            row = tl.load(Pos + t * TOP_K + j).to(tl.int64)
            down = tl.load(Down + row * hidden + cols, mask=ok, other=0.0).to(tl.float32)
            acc += down * tl.load(RouteW + t * TOP_K + j)
        else:
            acc += tl.load(Down + (t * TOP_K + j) * hidden + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_ADD:
        acc += tl.load(Add + t * hidden + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(Out + t * hidden + cols, acc.to(Out.dtype.element_ty), mask=ok)


def combine(
    down: torch.Tensor,
    top_k: int,
    add: torch.Tensor | None,
    pos: torch.Tensor | None = None,
    route_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """out[t] = sum of down[t * top_k + j] over j (+ add[t]), summed in float32 and rounded once.

    With pos (and route_weights): down is in sorted order and pair p's row is down[pos[p]], weighed by
    route_weights[p] (float32) before the sum.

    One launch where torch's sum over the middle axis of [T, k, hidden] and the shared experts' add were two."""
    num_tokens, hidden = down.shape[0] // top_k, down.shape[1]
    out = torch.empty(num_tokens, hidden, dtype=down.dtype, device=down.device)
    block = min(1024, triton.next_power_of_2(hidden))
    _combine_kernel[(num_tokens, triton.cdiv(hidden, block))](
        down,
        add if add is not None else down,
        out,
        pos if pos is not None else down,
        route_weights if route_weights is not None else down,
        hidden,
        TOP_K=top_k,
        HAS_ADD=add is not None,
        GATHER=pos is not None,
        BLOCK=block,
        **pdl_launch(down),
    )
    return out
