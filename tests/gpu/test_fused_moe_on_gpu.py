"""On a GPU (skipped in CI): the expert sort at prefill sizes (the chunked two-launch sort, up to its limit) equals
the torch version, and the fused MoE over it equals the per-expert loop."""

import pytest
import torch
import torch.nn.functional as F

from mlaserve.kernels.moe.dispatch import GROUPED_MM, fused_experts
from mlaserve.kernels.moe.grouped_mm import grouped_mm_experts
from mlaserve.kernels.moe.sort import sort_by_expert, sort_by_expert_reference
from mlaserve.layers.moe import experts_reference

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize(
    "tokens, experts, top_k, block_m",
    # the chunked sort at 32, 96 and 128 chunks (its limit), 73 chunks of 32 pairs (257 bins); one program; torch
    [
        (512, 66, 8, 64),
        (1536, 66, 8, 128),
        (2048, 66, 8, 128),
        (257, 257, 9, 16),
        (100, 66, 8, 16),
        (8192, 66, 8, 128),
    ],
)
def test_sort_equals_the_torch_version(tokens, experts, top_k, block_m):
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    ids = torch.rand(tokens, experts, device="cuda", generator=gen).topk(top_k, dim=-1)[1]
    got = sort_by_expert(ids, experts, block_m)
    want = sort_by_expert_reference(ids, experts, block_m)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_fused_moe_at_a_prompt_of_512_tokens():
    gen = torch.Generator(device="cuda").manual_seed(0)
    experts, hidden, inter = 66, 256, 128
    x = torch.randn(512, hidden, device="cuda", generator=gen, dtype=torch.bfloat16)
    w13 = (torch.randn(experts, 2 * inter, hidden, device="cuda", generator=gen) / hidden**0.5).to(
        torch.bfloat16
    )
    w2 = (torch.randn(experts, hidden, inter, device="cuda", generator=gen) / inter**0.5).to(torch.bfloat16)
    ids = torch.rand(512, experts, device="cuda", generator=gen).topk(8, dim=-1)[1]
    weights = torch.rand(512, 8, device="cuda", generator=gen)
    got = fused_experts(x, w13, w2, weights, ids, F.silu).float()
    want = experts_reference(x, w13, w2, weights, ids, F.silu).float()
    assert (got - want).norm() / want.norm() < 1e-2


@pytest.mark.parametrize("tokens", [2200, 4096])  # from 256 pairs per expert (GROUPED_MM_PAIRS_PER_EXPERT)
def test_grouped_mm_path_at_prefill_sizes(tokens):
    """torch's grouped GEMM path, which fused_experts takes for long bf16 prompts on sm_90, against the Triton
    tiles and the per-expert loop."""
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    experts, hidden, inter = 66, 512, 256
    x = torch.randn(tokens, hidden, device="cuda", generator=gen, dtype=torch.bfloat16)
    w13 = (torch.randn(experts, 2 * inter, hidden, device="cuda", generator=gen) / hidden**0.5).bfloat16()
    w2 = (torch.randn(experts, hidden, inter, device="cuda", generator=gen) / inter**0.5).bfloat16()
    ids = torch.rand(tokens, experts, device="cuda", generator=gen).topk(8, dim=-1)[1]
    weights = torch.rand(tokens, 8, device="cuda", generator=gen)
    if torch.cuda.get_device_capability()[0] >= 9:
        assert GROUPED_MM.choose(x, w13, w2, weights, ids, F.silu) is not None
    want = experts_reference(x, w13, w2, weights, ids, F.silu).float()
    got = grouped_mm_experts(x, w13, w2, weights, ids, F.silu).float()
    tiles = fused_experts(x, w13, w2, weights, ids, F.silu, block_m=128).float()
    assert (got - want).norm() / want.norm() < 1e-2
    assert (got - tiles).norm() / tiles.norm() < 1e-2
