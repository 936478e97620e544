"""W8A8 block-FP8 experts (kernels/moe/: fp8 activations quantized per token group, fp8 x fp8 grouped GEMMs)
against the per-expert reference loop with quantize_activations=True, at an expert width (80) and hidden size
(224) that are no multiple of a 128-wide group, for group_n 1 and 128, top-k 2, over sorted tiles; and the table's
choice between W8A8 and W8A16. A twin test: the CPU interpreter in CI, natively on a GPU (`-m twin`)."""

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from mlaserve.kernels.kernel import first  # noqa: E402
from mlaserve.kernels.moe import dispatch  # noqa: E402
from mlaserve.kernels.moe.dispatch import MOE_KERNELS, W8A8_TILES, fused_experts  # noqa: E402
from mlaserve.kernels.moe.tiled import Fp8Scales, w8a8_tile_experts  # noqa: E402
from mlaserve.layers.block_fp8 import dequantize  # noqa: E402
from mlaserve.layers.moe import experts_reference  # noqa: E402
from mlaserve.testing.device import kernel_test_dtypes, on_gpu  # noqa: E402
from tests.kernels.test_moe_fp8 import HIDDEN, INTER, fp8_experts, routing  # noqa: E402

GPU = on_gpu()
DTYPES = kernel_test_dtypes()


def w8a8_tolerance(dtype: torch.dtype, want: torch.Tensor) -> dict[str, float]:
    """The gated activations reach the second GEMM rounded to x's dtype before they are quantized, where the
    reference quantizes them in float32: an fp8 step apart where they sit near a rounding boundary. On a GPU the
    fp8 products are also summed in the tensor cores' narrower accumulator."""
    scale = want.abs().amax().item()
    if dtype == torch.float32 and not GPU:
        return {"atol": 1e-3 * scale, "rtol": 1e-3}
    return {"atol": 2e-2 * scale, "rtol": 3e-2}


def reference(x, w13, s13, w2, s2, weights, ids, act, group_n, add=None) -> torch.Tensor:  # noqa: ANN001
    want = experts_reference(
        x.float(), dequantize(w13, s13, group_n), dequantize(w2, s2, group_n), weights, ids, act,
        quantize_activations=True,
    )  # fmt: skip
    return want if add is None else want + add.float()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group_n", [1, 128])
@pytest.mark.parametrize(
    "tokens, experts, block_m, fuse_gate",
    [(3, 4, 16, True), (40, 4, None, True), (40, 6, 16, True), (40, 4, None, False)]
    + ([(300, 8, None, True), (300, 8, 128, True), (300, 8, 128, False)] if GPU else []),
)  # a few pairs in 16-row tiles; 64-row tiles; many experts' 16-row tiles; gate and up as one GEMM
def test_w8a8_experts_match_the_quantized_reference(
    device, dtype, group_n, tokens, experts, block_m, fuse_gate
):
    gen = torch.Generator(device=device).manual_seed(tokens * experts + group_n)
    w13, s13, w2, s2 = fp8_experts(experts, group_n, gen)
    weights, ids = routing(tokens, experts, 2, gen)
    x = torch.randn(tokens, HIDDEN, generator=gen, device=device).to(dtype)
    shared = torch.randn(tokens, HIDDEN, generator=gen, device=device).to(dtype)
    fp8 = Fp8Scales(s13, s2, group_n)
    got = w8a8_tile_experts(x, w13, w2, weights, ids, F.silu, shared, fp8, block_m, fuse_gate=fuse_gate)
    assert got.dtype == dtype and got.shape == x.shape
    want = reference(x, w13, s13, w2, s2, weights, ids, F.silu, group_n, shared)
    torch.testing.assert_close(got.float(), want, **w8a8_tolerance(dtype, want))


def test_w8a8_experts_are_nearer_their_own_reference_than_the_unquantized_one(device):
    """The reference that quantizes activations is the one the kernel matches: the plain one is further off."""
    gen = torch.Generator(device=device).manual_seed(4)
    w13, s13, w2, s2 = fp8_experts(4, 128, gen)
    weights, ids = routing(24, 4, 2, gen)
    x = torch.randn(24, HIDDEN, generator=gen, device=device)
    got = fused_experts(x, w13, w2, weights, ids, F.silu, None, None, s13, s2, 128, kernel="fp8_w8a8_tiles")
    quantized = reference(x, w13, s13, w2, s2, weights, ids, F.silu, 128)
    plain = experts_reference(x, dequantize(w13, s13, 128), dequantize(w2, s2, 128), weights, ids, F.silu)
    assert (got - quantized).abs().max() * 10 < (got - plain).abs().max()


@pytest.mark.parametrize("group_n", [1, 128])
def test_w8a8_experts_with_an_activation_the_epilogue_does_not_fuse(device, group_n):
    gen = torch.Generator(device=device).manual_seed(12)
    w13, s13, w2, s2 = fp8_experts(5, group_n, gen)
    weights, ids = routing(9, 5, 2, gen)
    x = torch.randn(9, HIDDEN, generator=gen, device=device)
    got = fused_experts(
        x, w13, w2, weights, ids, F.gelu, w13_scale=s13, w2_scale=s2, group_n=group_n, kernel="fp8_w8a8_tiles"
    )
    want = reference(x, w13, s13, w2, s2, weights, ids, F.gelu, group_n)
    torch.testing.assert_close(got, want, **w8a8_tolerance(torch.float32, want))


def test_every_fp8_tile_down_the_ladder(device):
    """The gated W8A8 grouped GEMM on each tile its ladder may fall back to: K steps from 128 down to 32."""
    from mlaserve.kernels.fp8_quant import quantize_per_token_group
    from mlaserve.kernels.moe.grouped_gemm import fp8_tile_ladder, grouped_gemm
    from mlaserve.kernels.moe.sort import sort_by_expert
    from mlaserve.layers.block_fp8 import fake_quantize_per_token_group

    gen = torch.Generator(device=device).manual_seed(3)
    tokens, experts, top_k = 40, 4, 2
    w13, s13, _, _ = fp8_experts(experts, 128, gen)
    _, ids = routing(tokens, experts, top_k, gen)
    x = torch.randn(tokens, HIDDEN, generator=gen, device=device).half()
    rows = fake_quantize_per_token_group(x).float().repeat_interleave(top_k, 0)
    gate_up = torch.einsum("pk,pnk->pn", rows, dequantize(w13, s13, 128)[ids.flatten()])
    want = F.silu(gate_up[:, :INTER]) * gate_up[:, INTER:]
    sorted_ids, tile_expert = sort_by_expert(ids, experts, 64)
    rungs = fp8_tile_ladder(64, INTER, True, 232_448)
    assert len(rungs) > 3 and all(128 % t.block_k == 0 and t.block_k >= 32 for t in rungs)
    a, a_scale = quantize_per_token_group(x)
    for tile in rungs:
        got = grouped_gemm(
            a, w13, sorted_ids, tile_expert, tokens * top_k, top_k, None, 64, True, (tile,), s13, 128,
            a_scale, x.dtype,
        )  # fmt: skip
        torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=3e-2, msg=str(tile))


def test_the_table_takes_w8a8_for_fp8_experts_from_its_pairs_per_expert(monkeypatch):
    monkeypatch.setattr(dispatch, "W8A8_PAIRS_PER_EXPERT", 8)
    experts = 4
    w13 = torch.zeros(experts, 2 * INTER, HIDDEN).to(torch.float8_e4m3fn)
    w2 = torch.zeros(experts, HIDDEN, INTER).to(torch.float8_e4m3fn)
    fp8 = Fp8Scales(torch.ones(experts, 2, 2), torch.ones(experts, 2, 1), 128)

    def chosen(pairs: int, scales: tuple) -> str:
        x = torch.zeros(pairs // 2, HIDDEN).bfloat16()
        route = (torch.ones(pairs // 2, 2), torch.zeros(pairs // 2, 2, dtype=torch.long), F.silu, None)
        weights = (w13, w2) if scales else (w13.bfloat16(), w2.bfloat16())
        return first(MOE_KERNELS, x, *weights, *route, *scales).name

    assert chosen(8 * experts, (fp8,)) == "fp8_w8a8_tiles"
    assert chosen(8 * experts - 2, (fp8,)) == "sorted_tiles"
    assert chosen(8 * experts, ()) != "fp8_w8a8_tiles"
    assert W8A8_TILES.why_not(torch.zeros(1, HIDDEN), w13, w2, *(None,) * 4) == "takes block-FP8 experts"
    with pytest.raises(ValueError, match="fp8_w8a8_tiles takes block-FP8 experts"):
        fused_experts(torch.zeros(2, HIDDEN), w13.float(), w2.float(), torch.ones(2, 1),
                      torch.zeros(2, 1, dtype=torch.long), F.silu, kernel="fp8_w8a8_tiles")  # fmt: skip
    with pytest.raises(ValueError, match="kernel 'nope'"):
        fused_experts(torch.zeros(2, HIDDEN), w13.float(), w2.float(), torch.ones(2, 1),
                      torch.zeros(2, 1, dtype=torch.long), F.silu, kernel="nope")  # fmt: skip


def test_w8a8_tiles_stop_at_64_rows_and_split_the_gate_there(monkeypatch):
    """The W8A8 tiles' own plan: sorted_tile_rows' height up to 64 rows, gate and up as one GEMM from 64 rows."""
    from mlaserve.kernels.moe import tiled

    assert [tiled.w8a8_tile_rows(pairs, 4) for pairs in (8, 64, 128, 512, 4096)] == [16, 32, 64, 64, 64]
    seen = []
    monkeypatch.setattr(tiled, "sorted_tile_experts", lambda *args: seen.append(args[8:11]))
    for pairs in (64, 4096):
        ids = torch.zeros(pairs // 2, 2, dtype=torch.long)
        tiled.w8a8_tile_experts(None, torch.zeros(4, 1, 1), None, None, ids, F.silu)
    assert seen == [(32, True, True), (64, True, False)]
