"""On a GPU (skipped in CI): the compiled MLA decode kernel at DeepSeek's real widths (512 + 64), in the
configurations its defaults pick (page lookup one tile ahead, 32- or 64-row tiles by grid size) and the other
tile shapes, against the torch reference, eagerly and replayed from a CUDA graph. The CPU suite checks the same code
paths under the interpreter at tiny widths."""

import pytest
import torch

from mlaserve.attention.torch_ref import TorchBackend
from mlaserve.kernels.mla_decode.decode import mla_decode
from mlaserve.kernels.mla_decode.dispatch import KERNELS_BY_NAME
from mlaserve.kernels.mla_decode.tuning import decode_plan, mla_decode_tuned
from mlaserve.kvcache.quant import QUANTIZED, quantize_rows
from mlaserve.testing.paged_case import LAT, ROPE, paged_case

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

PAGE = 64
HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def skip_gluon_off_hopper(options: dict) -> None:
    if str(options.get("kernel", "")).startswith("gluon") and not HOPPER:
        pytest.skip("the Gluon split kernels need sm_90")


# The LSE tolerance of the fp8-dot kernel (gluon_fp8.py): its scores carry the fp8 tensor cores' accumulation
# error (LSE within 1.4e-3 at four shapes on an H200, docs/performance.md). A one-row
# context's LSE is a single score, with no averaging, so the tolerance leaves room; the last test here bounds the
# error against the cache's own rounding.
FP8_DOTS_LSE_ATOL = 8e-3


def check_eager_and_replayed(
    q: torch.Tensor, cache: torch.Tensor, meta, call, lse_atol: float = 2e-3
) -> None:
    """`call()` (a decode over q and cache, scale 0.07) matches the torch reference eagerly, and again when replayed
    from a CUDA graph after q was overwritten: the replay must read the new queries, so its result has to change."""
    want, want_lse = TorchBackend().decode(q.float(), cache, None, meta, 0.07, LAT, need_lse=True)
    got, lse = call()
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, want_lse, atol=lse_atol, rtol=2e-3)

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed, replayed_lse = call()
    q.copy_(torch.randn_like(q))
    want, want_lse = TorchBackend().decode(q.float(), cache, None, meta, 0.07, LAT, need_lse=True)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(replayed.float(), want, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(replayed_lse, want_lse, atol=lse_atol, rtol=2e-3)


@pytest.mark.parametrize("batch", [1, 48])  # a grid under one program per SM, and one that fills the GPU
@pytest.mark.parametrize(
    "options",
    [
        {},
        {"kernel": "triton", "page_ahead": False},
        {"kernel": "triton", "block_n": 64, "num_warps": 8},
        {"kernel": "triton", "block_n": 32, "num_warps": 4},
        {
            "kernel": "triton",
            "balanced": False,
        },  # one sequence per program, the 16-bit default's other layout
        {"kernel": "triton", "balanced": True},  # and the 8-bit one's
    ],
)
@pytest.mark.parametrize("kv", ["bf16", "fp8_e4m3"])
def test_matches_reference_eager_and_in_a_graph(batch, options, kv):
    gen = torch.Generator().manual_seed(batch)
    lengths = torch.randint(1, 3000, (batch,), generator=gen).tolist()
    q, cache, table, meta = paged_case(batch, 16, lengths, PAGE, torch.bfloat16, seed=batch)
    if kv != "bf16":
        cache = quantize_rows(cache, QUANTIZED[kv])
    # The split count sized for a longer max_model_len than any sequence, as the engine's decode graphs run it.
    fp8_dots = decode_plan(q, cache, 8192, LAT, ROPE, **options).kernel == "gluon_fp8"
    check_eager_and_replayed(
        q,
        cache,
        meta,
        lambda: mla_decode_tuned(q, cache, table, meta.seq_lens, 8192, LAT, 0.07, **options),
        lse_atol=FP8_DOTS_LSE_ATOL if fp8_dots else 2e-3,
    )


@pytest.mark.parametrize("batch", [1, 9])
@pytest.mark.parametrize("heads", [128, 96])  # 96: the second head group is half masked
@pytest.mark.parametrize("page", [64, 128])
@pytest.mark.parametrize(
    "kernel", ["gluon_wgmma", "triton"]
)  # the Gluon split kernel, and the one it replaces
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_many_heads_match_reference_eager_and_in_a_graph(batch, heads, page, kernel, dtype):
    skip_gluon_off_hopper({"kernel": kernel})
    gen = torch.Generator().manual_seed(batch + heads + page)
    lengths = torch.randint(1, 3000, (batch,), generator=gen).tolist()
    lengths[0] = 1  # a one-row context: one masked tile
    q, cache, table, meta = paged_case(batch, heads, lengths, page, dtype, seed=batch + heads)
    check_eager_and_replayed(
        q,
        cache,
        meta,
        lambda: mla_decode_tuned(q, cache, table, meta.seq_lens, 8192, LAT, 0.07, kernel=kernel),
    )


@pytest.mark.parametrize(
    "heads, kv, kernel, options",
    [
        (16, "bf16", "triton", {}),  # balanced spans
        (16, "bf16", "triton", {"balanced": False}),
        (128, "bf16", "gluon_wgmma", {}),
        (16, "fp8_e4m3", "gluon_wgmma8", {}),
        (16, "fp8_e4m3", "gluon_fp8", {}),
        (16, "int8", "triton", {}),
        (16, "int8", "triton", {"balanced": True}),
    ],
)
def test_uneven_lengths_take_splits_by_share(heads, kv, kernel, options):
    """The mixed workload's shape of batch: many short contexts and a few long ones, the grid sized for a longer
    max_model_len with room for the long ones to take more splits (rules.grid_splits), or (the Triton
    kernel's balanced spans) every program an equal run of the batch's rows. Every kernel's slices must still
    cover each context exactly once, eagerly and replayed."""
    skip_gluon_off_hopper({"kernel": kernel})
    gen = torch.Generator().manual_seed(heads)
    lengths = torch.randint(16, 700, (40,), generator=gen).tolist()
    lengths[3], lengths[17], lengths[30] = 4500, 1, 2900
    q, cache, table, meta = paged_case(len(lengths), heads, lengths, PAGE, torch.bfloat16, seed=heads)
    if kv != "bf16":
        cache = quantize_rows(cache, QUANTIZED[kv])
    plan = decode_plan(q, cache, 10240, LAT, ROPE, kernel=kernel, **options)
    # every kernel here leaves spare splits for the long ones, or balances the rows
    assert plan.balanced or (KERNELS_BY_NAME[kernel].grid_room and plan.num_splits > plan.split_target)
    check_eager_and_replayed(
        q,
        cache,
        meta,
        lambda: mla_decode_tuned(q, cache, table, meta.seq_lens, 10240, LAT, 0.07, kernel=kernel, **options),
        lse_atol=FP8_DOTS_LSE_ATOL if kernel == "gluon_fp8" else 2e-3,
    )


@pytest.mark.skipif(not HOPPER, reason="the Gluon split kernel needs sm_90")
def test_wgmma_is_the_default_for_many_heads_on_hopper():
    q, cache, table, meta = paged_case(2, 128, [100, 200], 64, torch.bfloat16, seed=0)
    assert decode_plan(q, cache, 256, LAT, ROPE).kernel == "gluon_wgmma"
    default, _ = mla_decode(q, cache, table, meta.seq_lens, 256, LAT, 0.07)
    gluon, _ = mla_decode_tuned(q, cache, table, meta.seq_lens, 256, LAT, 0.07, kernel="gluon_wgmma")
    assert torch.equal(default, gluon)
    with pytest.raises(ValueError, match="'gluon_wgmma' takes no block_n"):
        mla_decode_tuned(q, cache, table, meta.seq_lens, 256, LAT, 0.07, kernel="gluon_wgmma", block_n=32)


@pytest.mark.skipif(not HOPPER, reason="the Gluon split kernels need sm_90")
@pytest.mark.parametrize("batch", [1, 48])
@pytest.mark.parametrize(
    "kv, kernel", [("fp8_e4m3", "gluon_fp8"), ("fp8_e4m3", "gluon_wgmma8"), ("int8", "gluon_wgmma8")]
)
@pytest.mark.parametrize("heads", [16, 20])  # 20: a second head group, mostly masked
def test_8bit_gluon_kernel_matches_reference_eager_and_in_a_graph(batch, kv, kernel, heads):
    gen = torch.Generator().manual_seed(batch + heads)
    lengths = torch.randint(1, 3000, (batch,), generator=gen).tolist()
    lengths[0] = 1
    q, cache, table, meta = paged_case(batch, heads, lengths, PAGE, torch.bfloat16, seed=batch)
    cache = quantize_rows(cache, QUANTIZED[kv])
    check_eager_and_replayed(
        q,
        cache,
        meta,
        lambda: mla_decode_tuned(q, cache, table, meta.seq_lens, 8192, LAT, 0.07, kernel=kernel),
        lse_atol=FP8_DOTS_LSE_ATOL if kernel == "gluon_fp8" else 2e-3,
    )


@pytest.mark.skipif(not HOPPER, reason="the Gluon split kernels need sm_90")
def test_fp8_dots_error_is_small_beside_the_caches():
    """The fp8-dot kernel's distance from the reference over the dequantized cache is a small part of what storing
    the cache in fp8 moved the result (the reference over the bf16 cache), for outputs and LSEs alike."""
    gen = torch.Generator().manual_seed(7)
    lengths = [1, 64, 700] + torch.randint(1, 5000, (13,), generator=gen).tolist()
    q, cache, table, meta = paged_case(len(lengths), 16, lengths, PAGE, torch.bfloat16, seed=7)
    rows8 = quantize_rows(cache, QUANTIZED["fp8_e4m3"])
    exact, exact_lse = TorchBackend().decode(q.float(), cache, None, meta, 0.07, LAT, need_lse=True)
    want, want_lse = TorchBackend().decode(q.float(), rows8, None, meta, 0.07, LAT, need_lse=True)
    got, lse = mla_decode_tuned(q, rows8, table, meta.seq_lens, 8192, LAT, 0.07, kernel="gluon_fp8")
    widened, _ = mla_decode_tuned(q, rows8, table, meta.seq_lens, 8192, LAT, 0.07, kernel="gluon_wgmma8")
    assert (got.float() - want).abs().max() < 0.25 * (want - exact).abs().max()
    assert (lse - want_lse).abs().max() < 0.25 * (want_lse - exact_lse).abs().max()
    # and within a small multiple of the widening kernel's output error
    assert (got.float() - want).abs().max() < 3 * (widened.float() - want).abs().max() + 1e-3


def poison_rows_past_the_ends(rows: torch.Tensor, table: torch.Tensor, lengths: list[int]) -> None:
    """Fill the rows of each sequence's last page past its end with 0xFF bytes (NaN in e4m3, bf16 and float32
    scales alike), as a page freed by a request whose values overflowed would leave them."""
    flat = rows.view(-1, rows.shape[-1]).view(torch.uint8)
    page = rows.shape[1]
    for b, length in enumerate(lengths):
        last = -(-length // page) * page
        for pos in range(length, last):
            flat[int(table[b, pos // page]) * page + pos % page] = 0xFF


@pytest.mark.parametrize("page", [64, 128])
@pytest.mark.parametrize(
    "kv, options",
    [
        ("bf16", {}),
        ("fp8_e4m3", {}),
        ("fp8_e4m3", {"kernel": "gluon_fp8"}),
        ("fp8_e4m3", {"num_splits": 3}),
        ("fp8_e4m3", {"kernel": "gluon_wgmma8"}),
        ("fp8_e4m3", {"kernel": "triton", "block_n": 32, "num_warps": 4}),
        ("int8", {"kernel": "gluon_wgmma8"}),
    ],
)
def test_stale_bytes_past_a_sequence_end_do_not_reach_the_result(page, kv, options):
    """A sequence's last page holds rows past its end that the kernels copy with the tile but must never let in:
    a NaN there times p = 0 is still NaN. The 8-bit rows' scales are poisoned too."""
    skip_gluon_off_hopper(options)
    lengths = [1, 63, 65, 700, 2500, 130]
    q, cache, table, meta = paged_case(len(lengths), 16, lengths, page, torch.bfloat16, seed=11)
    if kv != "bf16":
        cache = quantize_rows(cache, QUANTIZED[kv])
    want, want_lse = TorchBackend().decode(q.float(), cache, None, meta, 0.07, LAT, need_lse=True)
    poison_rows_past_the_ends(cache, table, lengths)
    got, lse = mla_decode_tuned(q, cache, table, meta.seq_lens, 4096, LAT, 0.07, **options)
    fp8_dots = decode_plan(q, cache, 4096, LAT, ROPE, **options).kernel == "gluon_fp8"
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, want_lse, atol=FP8_DOTS_LSE_ATOL if fp8_dots else 2e-3, rtol=2e-3)
