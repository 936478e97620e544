"""Block-FP8 experts in the fused MoE (kernels/moe/: W8A16 in the grouped GEMM) against the per-expert reference
loop on layers/block_fp8.dequantize's weights, at an expert width (80) and hidden size (224) that are no multiple
of a 128-wide block, for group_n 1 and 128. A twin test: the CPU interpreter in CI, natively on a GPU (`-m twin`)."""

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from mlaserve.kernels.moe import dispatch  # noqa: E402
from mlaserve.kernels.moe.dispatch import GROUPED_MM, fused_experts  # noqa: E402
from mlaserve.kernels.moe.tiled import Fp8Scales  # noqa: E402
from mlaserve.layers.block_fp8 import dequantize, quantize  # noqa: E402
from mlaserve.layers.moe import experts_reference  # noqa: E402
from mlaserve.testing.device import kernel_test_dtypes, on_gpu  # noqa: E402

GPU = on_gpu()
DTYPES = kernel_test_dtypes()
INTER, HIDDEN = 80, 224


def tolerance(dtype: torch.dtype) -> float:
    return 1e-4 if dtype == torch.float32 else 3e-2


def bf16_aware_tolerance(dtype: torch.dtype, want: torch.Tensor) -> dict[str, float]:
    """The kernels hand the gated activations from one GEMM to the next in x's dtype. Blocks two decades apart
    make those activations large, so in bf16 (8-bit mantissa) their rounding reaches small outputs as an absolute
    error of about a bf16 step at the largest output's scale."""
    tol = tolerance(dtype)
    atol = max(tol, 2**-7 * want.abs().amax().item()) if dtype == torch.bfloat16 else tol
    return {"atol": atol, "rtol": tol}


def fp8_experts(experts: int, group_n: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """(w13, w13_scale, w2, w2_scale): fp8 experts whose blocks span two decades, so a misplaced scale shows."""
    dev = gen.device
    w13 = torch.randn(experts, 2 * INTER, HIDDEN, generator=gen, device=dev) * HIDDEN**-0.5
    w13 *= torch.logspace(-1, 1, 2 * INTER, device=dev)[:, None]
    w2 = torch.randn(experts, HIDDEN, INTER, generator=gen, device=dev) * INTER**-0.5
    w2 *= torch.logspace(-1, 1, HIDDEN, device=dev)[:, None]
    return (*quantize(w13, block_n=group_n), *quantize(w2, block_n=group_n))


def routing(tokens: int, experts: int, top_k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    dev = gen.device
    ids = torch.stack([torch.randperm(experts, device=dev, generator=gen)[:top_k] for _ in range(tokens)])
    return torch.rand(tokens, top_k, device=dev, generator=gen), ids


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group_n", [1, 128])
@pytest.mark.parametrize(
    "tokens, experts, block_m",
    [(1, 8, None), (3, 24, None), (40, 4, None), (40, 6, 16)]
    + ([(300, 8, None), (300, 8, 128)] if GPU else []),
)  # one pair per tile; pair tiles over a few tokens; sorted 64-row tiles; sorted 16-row tiles
def test_fp8_experts_match_the_dequantized_reference(
    device, dtype, group_n, tokens, experts, block_m, monkeypatch
):
    """The W8A16 tiles (the table's W8A8 ones are off here; tests/kernels/test_moe_w8a8.py checks those)."""
    monkeypatch.setattr(dispatch, "W8A8_PAIRS_PER_EXPERT", None)
    gen = torch.Generator(device=device).manual_seed(tokens * experts + group_n)
    w13, s13, w2, s2 = fp8_experts(experts, group_n, gen)
    weights, ids = routing(tokens, experts, 2, gen)
    x = torch.randn(tokens, HIDDEN, generator=gen, device=device).to(dtype)
    shared = torch.randn(tokens, HIDDEN, generator=gen, device=device).to(dtype)
    want = experts_reference(
        x.float(), dequantize(w13, s13, group_n), dequantize(w2, s2, group_n), weights, ids, F.silu
    )
    got = fused_experts(x, w13, w2, weights, ids, F.silu, block_m, shared, s13, s2, group_n)
    want = want + shared.float()
    torch.testing.assert_close(got.float(), want, **bf16_aware_tolerance(dtype, want))


@pytest.mark.parametrize("group_n", [1, 128])
def test_fp8_experts_with_an_activation_the_epilogue_does_not_fuse(device, group_n):
    gen = torch.Generator(device=device).manual_seed(11)
    w13, s13, w2, s2 = fp8_experts(5, group_n, gen)
    weights, ids = routing(9, 5, 2, gen)
    x = torch.randn(9, HIDDEN, generator=gen, device=device)
    want = experts_reference(
        x, dequantize(w13, s13, group_n), dequantize(w2, s2, group_n), weights, ids, F.gelu
    )
    got = fused_experts(x, w13, w2, weights, ids, F.gelu, w13_scale=s13, w2_scale=s2, group_n=group_n)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_tile_down_the_ladder_scales_fp8_experts(device, dtype):
    """The gated grouped GEMM over fp8 experts (gate and up rows scaled from their own scale rows) on each tile
    its ladder may fall back to: every K step divides the 128-wide scale column."""
    from mlaserve.kernels.moe.grouped_gemm import grouped_gemm, tile_ladder
    from mlaserve.kernels.moe.sort import sort_by_expert

    gen = torch.Generator(device=device).manual_seed(3)
    tokens, experts, top_k = 40, 4, 2
    w13, s13, _, _ = fp8_experts(experts, 128, gen)
    _, ids = routing(tokens, experts, top_k, gen)
    x = torch.randn(tokens, HIDDEN, generator=gen, device=device).to(dtype)
    rows = x.float().repeat_interleave(top_k, 0)
    gate_up = torch.einsum("pk,pnk->pn", rows, dequantize(w13, s13, 128)[ids.flatten()])
    want = F.silu(gate_up[:, :INTER]) * gate_up[:, INTER:]
    sorted_ids, tile_expert = sort_by_expert(ids, experts, 64)
    rungs = tile_ladder(64, INTER, HIDDEN, x.element_size(), True, 232_448)
    assert len(rungs) > 3 and all(128 % t.block_k == 0 for t in rungs)
    tol = tolerance(dtype)
    for tile in rungs:
        got = grouped_gemm(
            x, w13, sorted_ids, tile_expert, tokens * top_k, top_k, None, 64, True, (tile,), s13, 128
        )
        torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol, msg=str(tile))


def test_fp8_experts_stay_off_torchs_grouped_gemm_and_need_their_scales():
    experts = 4
    w13 = torch.zeros(experts, 2 * INTER, HIDDEN).to(torch.float8_e4m3fn)
    w2 = torch.zeros(experts, HIDDEN, INTER).to(torch.float8_e4m3fn)
    s13, s2 = torch.ones(experts, 2, 2), torch.ones(experts, 2, 1)
    x, pairs = torch.zeros(1, HIDDEN).bfloat16(), 256 * experts
    route = (torch.ones(1, pairs), torch.zeros(1, pairs, dtype=torch.long), F.silu, None)
    fp8 = Fp8Scales(s13, s2, 128)
    assert (
        GROUPED_MM.why_not(x, w13.bfloat16(), w2.bfloat16(), *route, fp8)
        == "takes bf16 weights, not block FP8"
    )
    with pytest.raises(ValueError, match="w13's float32 block scale"):
        fused_experts(x, w13, w2, *route[:3])
    with pytest.raises(ValueError, match="w2's scale as float32 \\(4, 224, 1\\)"):
        fused_experts(x, w13, w2, *route[:3], w13_scale=torch.ones(4, 160, 2), w2_scale=s2, group_n=1)
