"""The fused MoE paths (kernels/moe/: the table, sorted and pair tiles, torch's grouped GEMM) against the per-expert
reference loop, under TRITON_INTERPRET=1."""

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from mlaserve.kernels.kernel import first  # noqa: E402
from mlaserve.kernels.moe.dispatch import (  # noqa: E402
    GROUPED_MM,
    GROUPED_MM_PAIRS_PER_EXPERT,
    MOE_KERNELS,
    fused_experts,
    tile_plan,
)
from mlaserve.kernels.moe.grouped_mm import grouped_mm_experts  # noqa: E402
from mlaserve.kernels.moe.sort import sort_by_expert, sort_by_expert_reference  # noqa: E402
from mlaserve.layers.moe import experts_reference  # noqa: E402


@pytest.mark.parametrize(
    "tokens, experts, top_k, hidden, inter, act",
    [
        (5, 8, 2, 32, 16, F.silu),
        (19, 6, 3, 48, 40, F.silu),
        (1, 4, 1, 16, 16, F.silu),  # one pair per tile, no sort
        (3, 24, 2, 32, 24, F.silu),  # pair tiles over several tokens
        (40, 4, 2, 32, 16, F.silu),  # 64-row tiles
        (300, 2, 1, 32, 16, F.silu),  # 128-row tiles
        (7, 8, 2, 32, 16, F.gelu),  # an activation the GEMM epilogue does not fuse
    ],
)
def test_fused_matches_reference(tokens, experts, top_k, hidden, inter, act):
    gen = torch.Generator().manual_seed(tokens * experts)
    x = torch.randn(tokens, hidden, generator=gen)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.1
    w2 = torch.randn(experts, hidden, inter, generator=gen) * 0.1
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=gen)
    want = experts_reference(x, w13, w2, weights, ids, act)
    got = fused_experts(x, w13, w2, weights, ids, act)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tokens", [1, 9])
def test_fused_adds_the_shared_output_in_its_combine(tokens):
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, 32, generator=gen)
    w13, w2 = torch.randn(8, 32, 32, generator=gen) * 0.1, torch.randn(8, 32, 16, generator=gen) * 0.1
    ids = torch.stack([torch.randperm(8, generator=gen)[:2] for _ in range(tokens)])
    weights, shared = torch.rand(tokens, 2, generator=gen), torch.randn(tokens, 32, generator=gen)
    want = experts_reference(x, w13, w2, weights, ids, F.silu) + shared
    torch.testing.assert_close(fused_experts(x, w13, w2, weights, ids, F.silu, add=shared), want)


@pytest.mark.parametrize("act", [F.silu, F.gelu])
def test_grouped_mm_path_matches_reference(act):
    """torch's grouped GEMM over unpadded expert runs (an empty expert, one expert taking most pairs), the combine
    reading rows back through the sort and weighing them; bf16, as the path requires."""
    gen = torch.Generator().manual_seed(7)
    tokens, experts, top_k, hidden, inter = 37, 6, 3, 32, 24
    x = torch.randn(tokens, hidden, generator=gen).bfloat16()
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.1).bfloat16()
    w2 = (torch.randn(experts, hidden, inter, generator=gen) * 0.1).bfloat16()
    # the last expert gets no pair, expert 0 about half of them
    ids = torch.stack([torch.randperm(experts - 1, generator=gen)[:top_k] for _ in range(tokens)])
    ids[::2, 0] = 0
    weights = torch.rand(tokens, top_k, generator=gen)
    shared = torch.randn(tokens, hidden, generator=gen).bfloat16()
    want = experts_reference(x, w13, w2, weights, ids, act).float() + shared.float()
    got = grouped_mm_experts(x, w13, w2, weights, ids, act, add=shared).float()
    torch.testing.assert_close(got, want, atol=3e-2, rtol=1e-2)  # both round each pair's output to bf16


def test_grouped_mm_takes_long_bf16_prompts_only():
    experts, hidden, inter = 4, 32, 16
    w13 = torch.zeros(experts, 2 * inter, hidden).bfloat16()
    w2 = torch.zeros(experts, hidden, inter).bfloat16()
    x = torch.zeros(1, hidden).bfloat16()
    enough = GROUPED_MM_PAIRS_PER_EXPERT * experts

    def call(pairs: int, *tensors: torch.Tensor) -> tuple:
        return (
            *(tensors or (x, w13, w2)),
            torch.ones(1, pairs),
            torch.zeros(1, pairs, dtype=torch.long),
            F.silu,
        )

    assert GROUPED_MM.why_not(*call(enough)) is None
    assert GROUPED_MM.why_not(*call(enough - 1)) == "does not pay at this call"
    assert GROUPED_MM.why_not(*call(enough, x.float(), w13.float(), w2.float())) == "takes bf16 only"
    odd = torch.zeros(experts, 2 * 12, hidden).bfloat16()  # rows of 12 bf16 values: not whole 16-byte rows
    odd_call = call(enough, x, odd, torch.zeros(experts, hidden, 12).bfloat16())
    assert GROUPED_MM.why_not(*odd_call) == "takes widths in whole 16-byte rows"


@pytest.mark.parametrize(
    "pairs, experts, dtype, path",
    [
        (6, 64, torch.bfloat16, "pair_tiles"),  # one pair per four experts or fewer
        (96, 64, torch.bfloat16, "sorted_tiles"),
        (256 * 64, 64, torch.bfloat16, "grouped_mm"),  # long bf16 prompts
        (256 * 64, 64, torch.float32, "sorted_tiles"),
    ],
)
def test_the_table_takes_the_first_path_that_fits_and_pays(pairs, experts, dtype, path):
    x = torch.zeros(1, 32, dtype=dtype)
    w13, w2 = torch.zeros(experts, 32, 32, dtype=dtype), torch.zeros(experts, 32, 16, dtype=dtype)
    ids = torch.zeros(1, pairs, dtype=torch.long)
    assert first(MOE_KERNELS, x, w13, w2, torch.ones(1, pairs), ids, F.silu).name == path


@pytest.mark.parametrize("pairs, experts, plan", [(6, 64, (16, True)), (96, 64, (16, False)), (1024, 64, (32, False)),
                                                  (2048, 64, (64, False)), (8192, 64, (128, False))])  # fmt: skip
def test_tile_plan(pairs, experts, plan):
    assert tile_plan(pairs, experts) == plan


def test_sort_by_expert_pads_each_expert_to_whole_tiles():
    ids = torch.tensor([[2, 0], [2, 1], [0, 2]])
    sorted_ids, tile_expert = sort_by_expert(ids, num_experts=4, block_m=4)
    sentinel = ids.numel()
    assert tile_expert.tolist()[:3] == [0, 1, 2] and all(e == -1 for e in tile_expert.tolist()[3:])
    tiles = sorted_ids.view(-1, 4).tolist()
    assert sorted(t for t in tiles[0] if t != sentinel) == [1, 4]  # expert 0: pairs (0,1) and (2,0)
    assert [t for t in tiles[1] if t != sentinel] == [3]
    assert sorted(t for t in tiles[2] if t != sentinel) == [0, 2, 5]


@pytest.mark.parametrize(
    "tokens, experts, top_k, block_m",
    # the last: DeepSeek-V3's 256 experts x top-8, 4,208 slots in 1,052 tiles (both chunked loops repeat)
    [
        (1, 64, 6, 16),
        (7, 8, 2, 4),
        (33, 6, 3, 16),
        (5, 160, 8, 16),
        (40, 4, 2, 64),
        pytest.param(430, 256, 8, 4, marks=pytest.mark.slow),  # 15 s under the interpreter
        # past ONE_PROGRAM_MAX_PAIRS: chunk counts, then the scatter (13 chunks of 128; 41 of 32 with 257 bins)
        (200, 64, 8, 64),
        (161, 256, 8, 16),
        (1100, 3, 1, 128),  # few experts, long runs over many chunks
    ],
)
def test_fused_sort_equals_the_torch_version(tokens, experts, top_k, block_m):
    gen = torch.Generator().manual_seed(tokens + experts)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    got = sort_by_expert(ids, experts, block_m)
    want = sort_by_expert_reference(ids, experts, block_m)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_every_tile_down_the_ladder_matches_the_reference(dtype):
    """The grouped GEMM at widths that are no multiple of its tiles (80 outputs, 224 deep), on each tile the
    ladder may fall back to (kernels/fit.py), 64-row gated tiles as a float32 prefill takes them."""
    from mlaserve.kernels.moe.grouped_gemm import grouped_gemm, tile_ladder

    gen = torch.Generator().manual_seed(3)
    tokens, experts, top_k, inter, hidden = 40, 4, 2, 80, 224
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.1).to(dtype)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    rows = x.float().repeat_interleave(top_k, 0)
    gate_up = torch.einsum("pk,pnk->pn", rows, w13.float()[ids.flatten()])
    want = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    sorted_ids, tile_expert = sort_by_expert(ids, experts, 64)
    rungs = tile_ladder(64, inter, hidden, x.element_size(), True, 232_448)
    assert len(rungs) > 3
    for tile in rungs:
        got = grouped_gemm(x, w13, sorted_ids, tile_expert, tokens * top_k, top_k, None, 64, True, (tile,))
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol, msg=str(tile))
