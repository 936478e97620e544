"""MoE routing on CUDA: the float32 gate GEMM for decode-sized batches, then scores, top-k, normalization and scaling in
one launch.

torch spends three kernels on the routing (softmax, top-k, scaling); here one program per token does all of it. The gate
itself cannot join that program: there it would stream the float32 gate weight through a single SM. For a few tokens
`gate_logits` spreads it over programs of a few experts each instead, one launch where cuBLAS took three (the cast of
the activations to float32, a dot and a reduce kernel); tl.dot's float32 mode was slower still. Greedy routing only
(softmax, or sigmoid with its correction bias and a single group); the torch functions in moe.py are the reference and
the path for group-limited routing.
"""

import torch
import triton
import triton.language as tl

from mlaserve.kernels.pdl import pdl_enter, pdl_launch
from mlaserve.kernels.registry import GATE_MAX_TOKENS


@triton.jit(do_not_specialize=["num_tokens"])
def _gate_kernel(
    X, W, Logits, num_tokens, num_experts, hidden, stride_x,
    BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, TOKENS_P2: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_enter(PDL)
    # Program = BLOCK_E experts for every token: each weight row is read once, the tokens' rows come from L2.
    e = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    e_ok = e < num_experts
    t = tl.arange(0, TOKENS_P2)
    t_ok = t < num_tokens
    acc = tl.zeros([TOKENS_P2, BLOCK_E], tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < hidden
        w = tl.load(W + e[:, None] * hidden + k[None, :], mask=e_ok[:, None] & k_ok[None, :], other=0.0)
        x = tl.load(X + t[:, None] * stride_x + k[None, :], mask=t_ok[:, None] & k_ok[None, :], other=0.0)
        acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], 2)
    tl.store(Logits + t[:, None] * num_experts + e[None, :], acc, mask=t_ok[:, None] & e_ok[None, :])


def gate_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [T <= GATE_MAX_TOKENS, hidden] (any float dtype) @ weight [E, hidden]^T in float32 -> [T, E] float32,
    as F.linear(x.float(), weight.float()) but one launch."""
    num_tokens, hidden = x.shape
    num_experts = weight.shape[0]
    if num_tokens > GATE_MAX_TOKENS or weight.shape[1] != hidden:
        raise ValueError(f"gate_logits: x {tuple(x.shape)} with weight {tuple(weight.shape)}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    logits = torch.empty(num_tokens, num_experts, dtype=torch.float32, device=x.device)
    if num_tokens == 0:
        return logits
    tokens_p2 = triton.next_power_of_2(num_tokens)
    block_k = max(
        16, min(triton.next_power_of_2(hidden), 2048 // tokens_p2)
    )  # [T, 4, K] product in registers
    _gate_kernel[(triton.cdiv(num_experts, 4),)](
        x, weight.contiguous(), logits, num_tokens, num_experts, hidden, x.stride(0),
        BLOCK_E=4, BLOCK_K=block_k, TOKENS_P2=tokens_p2, num_warps=4, **pdl_launch(x),
    )  # fmt: skip
    return logits


@triton.jit
def _route_kernel(
    Logits, Bias, Weights, Ids, num_experts, scaling,
    TOP_K: tl.constexpr, TOPK_P2: tl.constexpr, SIGMOID: tl.constexpr, NORMALIZE: tl.constexpr,
    BLOCK_E: tl.constexpr, NUM_SHARED: tl.constexpr, SHARED_P2: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    e_ok = e < num_experts
    logits = tl.load(Logits + t * num_experts + e, mask=e_ok, other=0.0)
    if SIGMOID:  # the bias steers which experts are chosen; the weights stay the plain scores
        scores = 1.0 / (1.0 + tl.exp(-logits))
        choose = scores + tl.load(Bias + e, mask=e_ok, other=0.0)
    else:
        p = tl.where(e_ok, tl.exp(logits - tl.max(tl.where(e_ok, logits, float("-inf")), 0)), 0.0)
        scores = p / tl.sum(p, 0)
        choose = scores
    choose = tl.where(e_ok, choose, float("-inf"))
    j = tl.arange(0, TOPK_P2)
    top_w = tl.zeros([TOPK_P2], tl.float32)
    top_i = tl.zeros([TOPK_P2], tl.int64)
    for k in tl.static_range(TOP_K):
        best = tl.argmax(choose, 0)
        top_w = tl.where(j == k, tl.sum(tl.where(e == best, scores, 0.0), 0), top_w)
        top_i = tl.where(j == k, best.to(tl.int64), top_i)
        choose = tl.where(e == best, float("-inf"), choose)
    if NORMALIZE:
        top_w = top_w / (tl.sum(top_w, 0) + 1e-20)
    row = t * (TOP_K + NUM_SHARED)
    tl.store(Weights + row + j, top_w * scaling, mask=j < TOP_K)
    tl.store(Ids + row + j, top_i, mask=j < TOP_K)
    if NUM_SHARED > 0:  # the shared experts, stored after the routed ones: every token, weight 1
        s = tl.arange(0, SHARED_P2)
        s_ok = s < NUM_SHARED
        tl.store(Weights + row + TOP_K + s, tl.full([SHARED_P2], 1.0, tl.float32), mask=s_ok)
        tl.store(Ids + row + TOP_K + s, (num_experts + s).to(tl.int64), mask=s_ok)


def route_greedy(
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    top_k: int,
    normalize: bool,
    scaling: float,
    num_shared: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] float32 -> (weights [T, top_k + num_shared] float32, ids [T, top_k + num_shared] int64):
    softmax routing when bias is None, else sigmoid routing steered by the bias. normalize: weights divided by
    their sum (norm_topk_prob). The last num_shared columns are the shared experts (ids E, E + 1, ..., weight 1),
    as moe.with_shared_experts appends them."""
    num_tokens, num_experts = logits.shape
    width = top_k + num_shared
    weights = torch.empty(num_tokens, width, dtype=torch.float32, device=logits.device)
    ids = torch.empty(num_tokens, width, dtype=torch.int64, device=logits.device)
    _route_kernel[(num_tokens,)](
        logits.contiguous(), bias if bias is not None else logits, weights, ids, num_experts, scaling,
        TOP_K=top_k, TOPK_P2=triton.next_power_of_2(top_k), SIGMOID=bias is not None,
        NORMALIZE=normalize and top_k > 1, BLOCK_E=triton.next_power_of_2(num_experts),
        NUM_SHARED=num_shared, SHARED_P2=triton.next_power_of_2(max(num_shared, 1)), **pdl_launch(logits),
    )  # fmt: skip
    return weights, ids
