"""MoE routing after the gate GEMM in one Triton launch: scores, top-k, normalization and scaling.

torch spends three kernels on it (softmax, top-k, scaling), about 7 us per MoE layer at one token on an H200;
here one program per token does all of it. The gate GEMM itself stays with cuBLAS: a first version that also
did it here, one program per token, streamed the float32 gate weight through a single SM and took 45 us.
Greedy routing only (softmax, or sigmoid with its correction bias and a single group); the torch functions in
moe.py are the reference and the path for group-limited routing.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _route_kernel(
    Logits, Bias, Weights, Ids, num_experts, scaling,
    TOP_K: tl.constexpr, TOPK_P2: tl.constexpr, SIGMOID: tl.constexpr, NORMALIZE: tl.constexpr,
    BLOCK_E: tl.constexpr,
):  # fmt: skip
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
    tl.store(Weights + t * TOP_K + j, top_w * scaling, mask=j < TOP_K)
    tl.store(Ids + t * TOP_K + j, top_i, mask=j < TOP_K)


def route_greedy(
    logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, normalize: bool, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] float32 -> (weights [T, top_k] float32, ids [T, top_k] int64): softmax routing when bias
    is None, else sigmoid routing steered by the bias. normalize: weights divided by their sum (norm_topk_prob)."""
    num_tokens, num_experts = logits.shape
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=logits.device)
    _route_kernel[(num_tokens,)](
        logits.contiguous(), bias if bias is not None else logits, weights, ids, num_experts, scaling,
        TOP_K=top_k, TOPK_P2=triton.next_power_of_2(top_k), SIGMOID=bias is not None,
        NORMALIZE=normalize and top_k > 1, BLOCK_E=triton.next_power_of_2(num_experts),
    )  # fmt: skip
    return weights, ids
