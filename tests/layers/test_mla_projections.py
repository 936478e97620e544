"""Which of MLA's projections share a GEMM (layers/mla.py): q's first projection and kv_a are one weight where
neither is split over ranks and their biases agree; the split is column views of that GEMM's output."""

import pytest
import torch
from transformers import DeepseekV2Config

from mlaserve.layers.mla import MLAAttention
from mlaserve.parallel import ParallelContext


def config(**changes) -> DeepseekV2Config:
    shape = dict(hidden_size=64, num_attention_heads=4, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16,
                 v_head_dim=16, q_lora_rank=None, attention_bias=False)  # fmt: skip
    return DeepseekV2Config(**{**shape, **changes})


@pytest.mark.parametrize(
    "changes, ctx, fused",
    [
        ({}, ParallelContext(), True),  # V2: q_proj with kv_a
        ({}, ParallelContext(0, 2), False),  # V2's q_proj is split over ranks, kv_a is not
        ({"attention_bias": True}, ParallelContext(), False),  # V2's q_proj has no bias, kv_a has one
        ({"q_lora_rank": 24}, ParallelContext(0, 2), True),  # V3-style q_a_proj: replicated like kv_a
        ({"q_lora_rank": 24, "attention_bias": True}, ParallelContext(), True),
    ],
)
def test_fused_where_neither_is_split_and_biases_agree(changes, ctx, fused):
    attn = MLAAttention(config(**changes), None, ctx)
    assert attn.fused_qkv_a is fused
    assert hasattr(attn, "fused_qkv_a_proj") is fused
    assert hasattr(attn, "kv_a_proj_with_mqa") is not fused


@pytest.mark.parametrize("q_lora_rank", [None, 24])
def test_fused_projection_equals_the_two_apart(q_lora_rank):
    torch.manual_seed(0)
    cfg = config(q_lora_rank=q_lora_rank)
    fused = MLAAttention(cfg, None, ParallelContext())
    q_width = q_lora_rank or 4 * (16 + 8)
    w_q, w_kv = torch.randn(q_width, 64), torch.randn(32 + 8, 64)
    proj = fused.fused_qkv_a_proj
    proj.weight_loader(proj.weight, w_q, 0)
    proj.weight_loader(proj.weight, w_kv, 1)
    hidden = torch.randn(5, 64)
    q, kv = fused.project_qkv_a(hidden)
    torch.testing.assert_close(q, hidden @ w_q.T)
    torch.testing.assert_close(kv, hidden @ w_kv.T)
