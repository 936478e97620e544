"""MoE routing for small batches in one Triton launch: gate GEMV in float32, scores, top-k, normalization.

A decode step's router was six kernels per MoE layer (upcast, two cuBLAS GEMV kernels, softmax, top-k, scaling),
about 12 us at one token on an H200; here one program per token does all of it. Greedy routing only (softmax,
or sigmoid with its correction bias and a single group); the torch functions in moe.py are the reference and
the path for group-limited routing and large batches.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _route_kernel(
    X, Wg, Bias, Weights, Ids, hidden, num_experts, stride_x, scaling,
    TOP_K: tl.constexpr, TOPK_P2: tl.constexpr, SIGMOID: tl.constexpr, NORMALIZE: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    e_ok = e < num_experts
    logits = tl.zeros([BLOCK_E], tl.float32)
    for h0 in range(0, hidden, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        h_ok = h < hidden
        x = tl.load(X + t * stride_x + h, mask=h_ok, other=0.0).to(tl.float32)
        w = tl.load(Wg + e[:, None] * hidden + h[None, :], mask=e_ok[:, None] & h_ok[None, :], other=0.0)
        logits += tl.sum(w * x[None, :], axis=1)
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
    tl.store(Weights + t * TOP_K + j, top_w * scaling, mask=j < TOP_K)
    tl.store(Ids + t * TOP_K + j, top_i, mask=j < TOP_K)


def route_greedy(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    bias: torch.Tensor | None,
    top_k: int,
    normalize: bool,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, top_k] float32, ids [T, top_k] int64): softmax routing when bias is None, else sigmoid
    routing steered by the bias. normalize: weights divided by their sum (norm_topk_prob)."""
    num_tokens, hidden = x.shape
    num_experts = gate_weight.shape[0]
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=x.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=x.device)
    block_e = triton.next_power_of_2(num_experts)
    _route_kernel[(num_tokens,)](
        x, gate_weight, bias if bias is not None else gate_weight, weights, ids,
        hidden, num_experts, x.stride(0), scaling,
        TOP_K=top_k, TOPK_P2=triton.next_power_of_2(top_k), SIGMOID=bias is not None,
        NORMALIZE=normalize and top_k > 1, BLOCK_E=block_e, BLOCK_H=max(16, min(128, 8192 // block_e)),
    )  # fmt: skip
    return weights, ids
