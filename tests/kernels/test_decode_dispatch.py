"""The decode dispatch table (mlaserve/kernels/mla_decode/dispatch.py), without running a kernel.

Invariants over any shape: every call gets the first kernel of the table that declares support for it and pays,
every plan fits the device's shared memory, and a named kernel refuses what it cannot run with the reason. The
tuning the table gives DeepSeek's shapes is one regenerated snapshot (snapshots/decode_plans.txt): retuning a rule
means regenerating it, `MLASERVE_UPDATE_SNAPSHOTS=1 pytest tests/kernels/test_decode_dispatch.py -k snapshot`,
and reading its diff.
"""

import dataclasses
import os
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mlaserve.kernels.mla_decode import dispatch
from mlaserve.kernels.mla_decode.dispatch import plan_shared_bytes
from mlaserve.kernels.mla_decode.rules import SHARED_BUDGET, DecodeCall, DecodeDevice, DecodePlan, DecodeShape
from mlaserve.kernels.mla_decode.tuning import tuned_plan

H200 = DecodeDevice("sm_90", 132, triton=True, gluon=True)
A100 = DecodeDevice("sm_80", 108, triton=True, gluon=False)
INTERPRETER = DecodeDevice(None, 4, triton=True, gluon=False)
NO_TRITON = DecodeDevice(None, 4, triton=False, gluon=False)
SMALL = DecodeDevice("sm_86", 84, triton=True, gluon=False, shared_bytes=101_376)
DTYPES = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
    "fp8": torch.float8_e4m3fn,
    "int8": torch.int8,
}
SNAPSHOT = Path(__file__).parent / "snapshots" / "decode_plans.txt"


def shape(heads: int, cache: str, query: str | None = None, page: int = 64, rank: int = 512, rope: int = 64):
    return DecodeShape(heads, rank, rope, DTYPES[cache], DTYPES[query or cache], page)


SHAPES = dict(
    heads=st.integers(1, 256),
    rank=st.integers(1, 1500),
    rope=st.integers(0, 300),
    page=st.sampled_from([1, 8, 16, 48, 64, 128, 256]),
    cache=st.sampled_from(sorted(DTYPES)),
    query=st.sampled_from(["bf16", "fp16", "fp32"]),
    batch=st.integers(1, 512),
    max_len=st.integers(1, 1 << 17),
    tma_rows=st.booleans(),
)


@settings(max_examples=400, deadline=None)
@given(device=st.sampled_from([H200, A100, INTERPRETER, NO_TRITON, SMALL]), **SHAPES)
def test_every_call_gets_the_first_kernel_that_declares_it_and_pays(
    device, heads, rank, rope, page, cache, query, batch, max_len, tma_rows
):
    decode = DecodeShape(heads, rank, rope, DTYPES[cache], DTYPES[query], page)
    call = DecodeCall(batch, max_len, tma_rows)
    kernel = dispatch.choose_kernel(decode, call, device)
    assert dispatch.refusal(kernel, decode, call, device) is None
    assert kernel.pays(decode, device)
    assert kernel.pays_per_call is None or kernel.pays_per_call(decode, call, device)
    earlier = dispatch.DECODE_KERNELS[: dispatch.DECODE_KERNELS.index(kernel)]
    for other in earlier:
        fits = dispatch.refusal(other, decode, call, device) is None
        per_call = other.pays_per_call is None or other.pays_per_call(decode, call, device)
        assert not (fits and other.pays(decode, device) and per_call)
    plan = dispatch.default_plan(decode, call, device)
    assert plan.kernel == kernel.name and plan.num_splits >= 1
    assert kernel.name in dispatch.describe(decode, device)  # the name the start-up log gives lists it
    if plan.kernel == "triton":  # tiles that tl.arange and tl.dot take, covering the widths
        for tile, width in ((plan.lat_tile, rank), (plan.rope_tile, rope)):
            assert tile >= max(16, width) and tile & (tile - 1) == 0
        assert plan.block_h >= 16 and plan.block_n >= 16


@settings(max_examples=400, deadline=None)
@given(device=st.sampled_from([H200, A100, INTERPRETER, SMALL]), **SHAPES)
def test_every_plan_fits_the_devices_shared_memory(
    device, heads, rank, rope, page, cache, query, batch, max_len, tma_rows
):
    """The engine's plan and each rung below it (what runs if a tile still does not build) take no more shared
    memory than the device gives a program: the Triton kernel's tiles shrink to fit, down to its smallest tile."""
    decode = DecodeShape(heads, rank, rope, DTYPES[cache], DTYPES[query], page)
    for plan in dispatch.default_ladder(decode, DecodeCall(batch, max_len, tma_rows), device):
        smallest = (plan.block_h, plan.block_n, plan.num_stages) == (16, 16, 1)
        limit = min(SHARED_BUDGET, device.shared_bytes) if plan.kernel == "triton" else device.shared_bytes
        assert plan_shared_bytes(plan, decode) <= limit or (plan.kernel == "triton" and smallest), plan


@settings(max_examples=300, deadline=None)
@given(
    device=st.sampled_from([H200, A100, INTERPRETER, NO_TRITON]),
    kernel=st.sampled_from(list(dispatch.KERNELS_BY_NAME)),
    **SHAPES,
)
def test_a_named_kernel_runs_what_it_declares_and_refuses_the_rest_with_the_reason(
    device, kernel, heads, rank, rope, page, cache, query, batch, max_len, tma_rows
):
    decode = DecodeShape(heads, rank, rope, DTYPES[cache], DTYPES[query], page)
    call = DecodeCall(batch, max_len, tma_rows)
    why = dispatch.refusal(dispatch.KERNELS_BY_NAME[kernel], decode, call, device)
    if why is None:
        assert tuned_plan(decode, call, device, kernel).kernel == kernel
    else:
        with pytest.raises(ValueError, match=f"decode kernel '{kernel}' cannot run .*: it {why}"):
            tuned_plan(decode, call, device, kernel)


@pytest.mark.parametrize("heads, cache, query", [(16, "bf16", None), (128, "bf16", None), (16, "fp8", "bf16"),
                                                 (128, "fp8", "bf16"), (16, "int8", "bf16")])  # fmt: skip
@pytest.mark.parametrize("batch, max_len", [(1, 16384), (64, 4096), (229, 10240)])
def test_deepseeks_plans_fit_an_sm90_program(heads, cache, query, batch, max_len):
    """The Gluon kernels' fixed tiles included, which the hypothesis shapes above rarely reach."""
    decode = shape(heads, cache, query)
    for plan in dispatch.default_ladder(decode, DecodeCall(batch, max_len), H200):
        assert plan_shared_bytes(plan, decode) <= H200.shared_bytes, plan


def describe_plan(plan: DecodePlan) -> str:
    """The plan's kernel and splits, then every field that differs from DecodePlan's defaults."""
    defaults = DecodePlan(plan.kernel, plan.num_splits)
    fields = [
        f"{f.name}={getattr(plan, f.name)}"
        for f in dataclasses.fields(plan)[2:]
        if getattr(plan, f.name) != getattr(defaults, f.name)
    ]
    return " ".join([plan.kernel, f"splits={plan.num_splits}", *fields]).replace("torch.", "")


def snapshot_lines() -> list[str]:
    """The engine's plan at DeepSeek's widths (512 + 64) for each device, heads, cache and query dtype, page and
    (batch, longest context)."""
    lines = []
    for name, device in (("H200", H200), ("A100", A100)):
        for heads in (16, 128):
            for cache, query in (("bf16", "bf16"), ("fp16", "fp16"), ("fp32", "fp32"), ("fp8", "bf16"),
                                 ("int8", "bf16"), ("fp8", "fp32")):  # fmt: skip
                for page in (16, 64):
                    for batch, max_len in ((1, 8192), (1, 16384), (8, 8192), (32, 2048), (40, 10240), (64, 4096),
                                           (128, 8192), (229, 10240)):  # fmt: skip
                        call = DecodeCall(batch, max_len)
                        plan = dispatch.default_plan(shape(heads, cache, query, page), call, device)
                        lines.append(f"{name} heads={heads} cache={cache} query={query} page={page} "
                                     f"batch={batch} max_len={max_len}: {describe_plan(plan)}")  # fmt: skip
    return lines


def test_deepseek_plans_match_the_snapshot():
    got = snapshot_lines()
    if os.environ.get("MLASERVE_UPDATE_SNAPSHOTS") == "1":
        SNAPSHOT.parent.mkdir(exist_ok=True)
        SNAPSHOT.write_text("\n".join(got) + "\n")
    want = SNAPSHOT.read_text().splitlines()
    changed = [f"- {w}\n+ {g}" for w, g in zip(want, got, strict=False) if w != g]
    assert len(got) == len(want) and not changed, (
        "the decode table's plans changed; if that is meant, regenerate the snapshot (this module's docstring):\n"
        + "\n".join(changed[:20])
    )


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
    """Rope tiles narrower than 64 did not build in the 16-bit and widening Gluon kernels (32 did in the fp8-dot
    one), nor did rank 512 with rope 128 in the 16-bit one (shared memory)."""
    assert (
        dispatch.describe(shape(16, "fp8", "bf16", rope=32), H200)
        == "gluon_fp8 where fp8_dots_pay, else triton"
    )
    assert dispatch.describe(shape(16, "fp8", "bf16", rope=128), H200).startswith("gluon_fp8")
    assert dispatch.describe(shape(128, "bf16", rope=128), H200) == "triton"
    assert dispatch.describe(shape(128, "bf16", rank=256), H200) == "gluon_wgmma"


def test_fp8_dots_need_rows_tma_can_copy():
    decode = shape(16, "fp8", "bf16")
    assert dispatch.default_plan(decode, DecodeCall(64, 4096, tma_rows=False), H200).kernel == "gluon_wgmma8"
    with pytest.raises(ValueError, match="16-byte aligned"):
        tuned_plan(decode, DecodeCall(64, 4096, tma_rows=False), H200, "gluon_fp8")


def test_named_kernels_take_only_the_knobs_they_list():
    """Benchmarks name kernels and pass their knobs (tuning.py); the engine's path takes neither."""
    decode = shape(16, "fp8", "bf16")
    call = DecodeCall(64, 4096)
    assert tuned_plan(decode, call, H200, "gluon_fp8", num_splits=3, pdl=False).num_splits == 3
    triton = tuned_plan(decode, call, H200, "triton", block_n=16, num_warps=2)
    assert (triton.kernel, triton.block_n, triton.num_warps) == ("triton", 16, 2)
    with pytest.raises(ValueError, match="'gluon_wgmma8' takes no block_n"):
        tuned_plan(decode, call, H200, "gluon_wgmma8", block_n=32)
    with pytest.raises(ValueError, match="unknown decode kernel 'wgmma'"):
        tuned_plan(decode, call, H200, "wgmma")


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
    """Below the engine's plan the ladder (what runs if a kernel still does not build) shrinks rung by rung to the
    smallest Triton tile."""
    wide = shape(128, "fp32", page=16)
    call = DecodeCall(1, 16384)
    roomy = dispatch.default_plan(wide, call, H200)
    tight = dispatch.default_plan(wide, call, dataclasses.replace(H200, shared_bytes=48 * 1024))
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


def test_the_seesaw_kernel_is_named_not_chosen_until_it_has_run_on_a_gpu(monkeypatch):
    """gluon_seesaw runs only where named (rules.SEESAW_BY_DEFAULT); once set, it takes the 64-head bf16 calls on
    sm_90 ahead of gluon_wgmma, whose split count it shares."""
    from mlaserve.kernels.mla_decode import rules

    decode, call = shape(128, "bf16", page=16), DecodeCall(64, 4096)
    assert dispatch.choose_kernel(decode, call, H200).name == "gluon_wgmma"
    named = tuned_plan(decode, call, H200, "gluon_seesaw")
    wgmma = tuned_plan(decode, call, H200, "gluon_wgmma")
    assert (named.kernel, named.block_h, named.block_n) == ("gluon_seesaw", 64, 32)
    assert (named.num_splits, named.split_target) == (wgmma.num_splits, wgmma.split_target)
    assert plan_shared_bytes(named, decode) <= H200.shared_bytes
    assert tuned_plan(decode, call, H200, "gluon_seesaw", block_n=64).block_n == 64
    with pytest.raises(ValueError, match="block_n 32 or 64, not 16"):
        tuned_plan(decode, call, H200, "gluon_seesaw", block_n=16)
    with pytest.raises(ValueError, match="'gluon_seesaw' cannot run .*takes kv_lora_rank 512"):
        tuned_plan(shape(128, "bf16", rank=256), call, H200, "gluon_seesaw")
    with pytest.raises(ValueError, match="'gluon_seesaw' cannot run .*takes caches of bfloat16/float16"):
        tuned_plan(shape(128, "fp8", "bf16"), call, H200, "gluon_seesaw")

    monkeypatch.setattr(rules, "SEESAW_BY_DEFAULT", True)
    dispatch.candidates.cache_clear()
    try:
        assert dispatch.choose_kernel(decode, call, H200).name == "gluon_seesaw"
        assert dispatch.describe(shape(96, "bf16"), H200) == "gluon_seesaw"
        assert dispatch.describe(shape(32, "bf16"), H200) == "triton"  # the 64-head rule
        assert dispatch.describe(shape(128, "bf16"), A100) == "triton"
    finally:
        dispatch.candidates.cache_clear()


def test_the_seesaw_kernel_copies_by_tma_only_tiles_inside_a_page():
    call = DecodeCall(64, 4096)
    assert tuned_plan(shape(128, "bf16"), call, H200, "gluon_seesaw", tma=True).tma
    assert not tuned_plan(shape(128, "bf16"), call, H200, "gluon_seesaw").tma
    with pytest.raises(ValueError, match="block_size 16 is not a multiple of block_n 32"):
        tuned_plan(shape(128, "bf16", page=16), call, H200, "gluon_seesaw", tma=True)
