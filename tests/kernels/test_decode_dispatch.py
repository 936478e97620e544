"""The decode dispatch table (mlaserve/kernels/mla_decode/dispatch.py), without running a kernel: every shape gets a
kernel that declares support for it, DeepSeek's shapes keep the kernels and launch parameters measured for them, and
the backends name their kernel."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mlaserve.kernels.mla_decode import dispatch
from mlaserve.kernels.mla_decode.rules import DecodeCall, DecodeDevice, DecodeShape
from mlaserve.kernels.mla_decode.tuning import tuned_plan

H200 = DecodeDevice("sm_90", 132, triton=True, gluon=True)
A100 = DecodeDevice("sm_80", 108, triton=True, gluon=False)
INTERPRETER = DecodeDevice(None, 4, triton=True, gluon=False)
NO_TRITON = DecodeDevice(None, 4, triton=False, gluon=False)
DTYPES = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
    "fp8": torch.float8_e4m3fn,
    "int8": torch.int8,
}


def shape(heads: int, cache: str, query: str | None = None, page: int = 64, rank: int = 512, rope: int = 64):
    return DecodeShape(heads, rank, rope, DTYPES[cache], DTYPES[query or cache], page)


@settings(max_examples=400, deadline=None)
@given(
    heads=st.integers(1, 256),
    rank=st.integers(1, 1500),
    rope=st.integers(0, 300),
    page=st.sampled_from([1, 8, 16, 48, 64, 128, 256]),
    cache=st.sampled_from(sorted(DTYPES)),
    query=st.sampled_from(["bf16", "fp16", "fp32"]),
    device=st.sampled_from([H200, A100, INTERPRETER, NO_TRITON]),
    batch=st.integers(1, 512),
    max_len=st.integers(1, 1 << 17),
    tma_rows=st.booleans(),
)
def test_every_shape_gets_a_kernel_that_declares_it(
    heads, rank, rope, page, cache, query, device, batch, max_len, tma_rows
):
    decode = DecodeShape(heads, rank, rope, DTYPES[cache], DTYPES[query], page)
    call = DecodeCall(batch, max_len, tma_rows)
    kernel = dispatch.choose_kernel(decode, call, device)
    assert kernel.supports(decode, device) is None
    assert kernel.pays(decode, device)
    assert kernel.pays_per_call is None or kernel.pays_per_call(decode, call, device)
    assert not kernel.tma_rows or tma_rows
    # ... and it is the first in the table that fits and pays
    earlier = dispatch.DECODE_KERNELS[: dispatch.DECODE_KERNELS.index(kernel)]
    for other in earlier:
        fits = other.supports(decode, device) is None and (tma_rows or not other.tma_rows)
        per_call = other.pays_per_call is None or other.pays_per_call(decode, call, device)
        assert not (fits and other.pays(decode, device) and per_call)
    plan = tuned_plan(decode, call, device)
    assert plan.kernel == kernel.name and plan.num_splits >= 1
    if plan.kernel == "triton":  # tiles that tl.arange and tl.dot take, covering the widths
        for tile, width in ((plan.lat_tile, rank), (plan.rope_tile, rope)):
            assert tile >= max(16, width) and tile & (tile - 1) == 0
        assert plan.block_h >= 16 and plan.block_n >= 16
    # the name the start-up log gives lists this kernel
    assert kernel.name in dispatch.describe(decode, device)


@pytest.mark.parametrize(
    "heads, rank, rope, page",
    [
        (1, 24, 8, 16),
        (5, 24, 8, 16),
        (6, 32, 8, 64),
        (40, 256, 32, 16),  # MiniCPM3
        (40, 256, 32, 64),
        (128, 96, 8, 64),
        (128, 256, 32, 64),  # a rope tile under 64 breaks the Gluon kernels' swizzled layouts
    ],
)
@pytest.mark.parametrize("cache, query", [("bf16", None), ("fp32", None), ("fp8", "bf16"), ("int8", "fp32")])
@pytest.mark.parametrize("device", [H200, A100, INTERPRETER])
def test_shapes_other_than_deepseeks_take_the_general_kernel(heads, rank, rope, page, cache, query, device):
    decode = shape(heads, cache, query, page, rank, rope)
    assert dispatch.describe(decode, device) == "triton"
    assert dispatch.describe(decode, NO_TRITON) == "torch reference"


# Today's launches at DeepSeek's widths (512 + 64), as the dispatcher before the table chose them on an H200 and an
# A100: (device, heads, cache, query, page, batch, max_len) -> kernel, splits, and for the Triton kernel
# (block_h, block_n, num_warps, num_stages, page_ahead, prefetch, q_f16, widen_bits and balanced). The 16-head
# Triton kernel over 16-bit caches lays out balanced spans from about 41 sequences (rules.spans_pay): its
# splits are then its programs, two per SM.
TRITON = (
    "block_h",
    "block_n",
    "num_warps",
    "num_stages",
    "page_ahead",
    "prefetch",
    "q_f16",
    "widen_bits",
    "balanced",
)
DEEPSEEK = [
    (H200, 16, "bf16", None, 64, 64, 4096, "triton", 264, (16, 32, 4, 3, True, False, False, False, True)),
    (H200, 16, "bf16", None, 64, 128, 8192, "triton", 264, (16, 32, 4, 3, True, False, False, False, True)),
    (H200, 16, "bf16", None, 64, 229, 10240, "triton", 264, (16, 32, 4, 3, True, False, False, False, True)),
    (H200, 16, "bf16", None, 64, 40, 10240, "triton", 7, (16, 32, 4, 3, True, False, False, False, False)),
    (H200, 16, "bf16", None, 64, 1, 16384, "triton", 64, (16, 64, 8, 3, True, False, False, False, False)),
    (H200, 16, "bf16", None, 16, 32, 2048, "triton", 8, (16, 64, 8, 3, False, False, False, False, False)),
    (H200, 128, "bf16", None, 64, 64, 4096, "gluon_wgmma", 1, None),
    (H200, 128, "bf16", None, 64, 1, 16384, "gluon_wgmma", 61, None),
    (H200, 128, "fp16", None, 128, 8, 8192, "gluon_wgmma", 8, None),
    (H200, 128, "bf16", None, 16, 64, 4096, "gluon_wgmma", 1, None),
    (H200, 16, "fp8", "bf16", 64, 64, 4096, "gluon_fp8", 2, None),
    (H200, 16, "fp8", "bf16", 64, 128, 8192, "gluon_fp8", 1, None),
    (H200, 8, "fp8", "bf16", 64, 32, 2048, "gluon_fp8", 4, None),
    (H200, 16, "fp8", "bf16", 64, 1, 8192, "gluon_wgmma8", 64, None),
    (H200, 16, "fp8", "bf16", 16, 64, 4096, "triton", 4, (16, 32, 4, 3, False, True, True, True, False)),
    (H200, 16, "int8", "bf16", 64, 64, 4096, "triton", 4, (16, 32, 4, 3, False, True, True, True, False)),
    (H200, 128, "fp8", "bf16", 64, 64, 4096, "gluon_wgmma8", 1, None),
    (H200, 16, "fp8", "fp32", 64, 64, 4096, "triton", 4, (16, 32, 4, 3, False, True, False, False, False)),
    (A100, 128, "bf16", None, 64, 64, 4096, "triton", 4, (64, 64, 8, 2, False, False, False, False, False)),
    (A100, 16, "fp8", "bf16", 64, 64, 4096, "triton", 3, (16, 32, 4, 3, False, True, True, True, False)),
]  # fmt: skip


@pytest.mark.parametrize(
    "device, heads, cache, query, page, batch, max_len, kernel, splits, triton", DEEPSEEK
)
def test_deepseek_shapes_keep_their_kernels_and_launches(
    device, heads, cache, query, page, batch, max_len, kernel, splits, triton
):
    plan = tuned_plan(shape(heads, cache, query, page), DecodeCall(batch, max_len), device)
    # the measured rule's count; the grid's has room for longer sequences (rules.grid_splits)
    assert (plan.kernel, plan.split_target or plan.num_splits) == (kernel, splits)
    assert plan.num_splits >= splits
    if triton is not None:
        assert tuple(getattr(plan, name) for name in TRITON) == triton
        assert (plan.lat_tile, plan.rope_tile) == (512, 64)


@pytest.mark.parametrize(
    "heads, cache, query, page, want",
    [
        (16, "bf16", None, 64, "triton"),
        (128, "bf16", None, 64, "gluon_wgmma"),
        (128, "bf16", None, 16, "gluon_wgmma"),
        (128, "fp8", "bf16", 64, "gluon_wgmma8"),
        (16, "fp8", "bf16", 64, "gluon_fp8 where fp8_dots_pay, else gluon_wgmma8"),
        (16, "int8", "bf16", 64, "triton"),
        (16, "fp8", "fp32", 64, "triton"),
    ],
)
def test_the_start_up_name_says_which_kernels_may_run(heads, cache, query, page, want):
    assert dispatch.describe(shape(heads, cache, query, page), H200) == want


def test_gluon_kernels_take_only_the_widths_they_were_built_at():
    """On an H200, rope tiles narrower than 64 did not build in the 16-bit and widening Gluon kernels (32 did in
    the fp8-dot one), nor did rank 512 with rope 128 in the 16-bit one (shared memory)."""
    assert (
        dispatch.describe(shape(16, "fp8", "bf16", rope=32), H200)
        == "gluon_fp8 where fp8_dots_pay, else triton"
    )
    assert dispatch.describe(shape(16, "fp8", "bf16", rope=128), H200).startswith("gluon_fp8")
    assert dispatch.describe(shape(128, "bf16", rope=128), H200) == "triton"
    assert dispatch.describe(shape(128, "bf16", rank=256), H200) == "gluon_wgmma"


def test_fp8_dots_need_rows_tma_can_copy():
    decode = shape(16, "fp8", "bf16")
    assert tuned_plan(decode, DecodeCall(64, 4096, tma_rows=False), H200).kernel == "gluon_wgmma8"
    with pytest.raises(ValueError, match="16-byte aligned"):
        tuned_plan(decode, DecodeCall(64, 4096, tma_rows=False), H200, "gluon_fp8")


def test_named_kernels_and_tuning():
    """Benchmarks name kernels and pass their knobs; the engine's path takes neither."""
    decode = shape(16, "fp8", "bf16")
    call = DecodeCall(64, 4096)
    assert tuned_plan(decode, call, H200, "gluon_wgmma8").kernel == "gluon_wgmma8"
    assert tuned_plan(decode, call, H200, "gluon_fp8", num_splits=3, pdl=False).num_splits == 3
    triton = tuned_plan(decode, call, H200, "triton", block_n=16, num_warps=2)
    assert (triton.kernel, triton.block_n, triton.num_warps) == ("triton", 16, 2)
    with pytest.raises(ValueError, match="'gluon_wgmma8' takes no block_n"):
        tuned_plan(decode, call, H200, "gluon_wgmma8", block_n=32)
    with pytest.raises(ValueError, match="'gluon_wgmma' cannot run .*takes caches of bfloat16/float16"):
        tuned_plan(decode, call, H200, "gluon_wgmma")
    with pytest.raises(ValueError, match="'gluon_fp8' cannot run .*needs gluon"):
        tuned_plan(decode, call, A100, "gluon_fp8")
    with pytest.raises(ValueError, match="takes kv_lora_rank 512"):
        tuned_plan(shape(16, "fp8", "bf16", rank=256), call, H200, "gluon_wgmma8")


def test_wide_rows_take_smaller_tiles():
    """fp32 rows at DeepSeek's widths are twice the bytes the tiles were measured with: half the rows per tile (and
    half the heads per program at 64), so a program's shared memory stays what it was at bf16."""
    bf16 = tuned_plan(shape(128, "bf16", page=16), DecodeCall(1, 16384), H200)
    fp32 = tuned_plan(shape(128, "fp32", page=16), DecodeCall(1, 16384), H200)
    assert (bf16.block_h, bf16.block_n) == (64, 64) and (fp32.block_h, fp32.block_n) == (32, 32)
    small = tuned_plan(shape(5, "fp32", page=16, rank=24, rope=8), DecodeCall(1, 16384), H200)
    assert (small.block_h, small.block_n, small.lat_tile, small.rope_tile) == (16, 64, 32, 16)
    # 8-bit rows prefetched into registers: the 64-head program built on an H200 once its tile had 32 rows (fp32
    # dots) or it had 32 heads (a 1,024-wide latent: the accumulator's layout conversion went through shared memory)
    int8 = tuned_plan(shape(128, "int8", "fp32"), DecodeCall(1, 16384), H200)
    wide = tuned_plan(shape(128, "fp8", "bf16", rank=1024), DecodeCall(1, 16384), H200)
    assert (int8.block_h, int8.block_n, wide.block_h, wide.block_n) == (64, 32, 32, 32)


def test_backends_name_their_decode_kernel():
    from mlaserve.attention.sdpa import SdpaBackend
    from mlaserve.attention.torch_ref import TorchBackend
    from mlaserve.attention.triton_mla import TritonMLABackend

    args = (5, 24, 8, torch.float32, 16, torch.device("cpu"))
    assert TorchBackend().decode_kernel(*args) == "torch reference"
    assert SdpaBackend().decode_kernel(*args) == "sdpa (paged torch decode)"
    assert TritonMLABackend().decode_kernel(*args) == "triton"  # the interpreter (tests/conftest.py)
    assert TritonMLABackend.decode_kernel_name == "sdpa (paged torch decode)"  # GQA decode


def test_a_device_with_less_shared_memory_gets_smaller_tiles():
    """The plan's tiles stay within what the device gives a program (DecodeDevice.shared_bytes), and the ladder
    below it (what runs if a kernel still does not build) shrinks rung by rung to the smallest Triton tile."""
    wide = shape(128, "fp32", page=16)
    call = DecodeCall(1, 16384)
    roomy = tuned_plan(wide, call, H200)
    small = DecodeDevice("sm_90", 132, triton=True, gluon=True, shared_bytes=48 * 1024)
    tight = tuned_plan(wide, call, small)
    assert tight.block_h * tight.block_n < roomy.block_h * roomy.block_n
    rungs = dispatch.default_ladder(shape(128, "bf16"), call, H200)
    assert rungs[0].kernel == "gluon_wgmma" and all(r.kernel == "triton" for r in rungs[1:])
    assert (rungs[-1].block_n, rungs[-1].block_h, rungs[-1].num_stages, rungs[-1].prefetch) == (
        16,
        16,
        1,
        False,
    )
    assert len(set(rungs)) == len(rungs)
