"""The decode variants the GPU scripts time (benchmarks/diagnose/h200_diagnose.py's sections, decode_sweep.py,
small_batch_sweep.py) name kernels and tuning knobs that mla_decode_tuned takes at their shapes on an H200: checked
against the dispatch table on a modelled sm_90 device, so a knob that left the engine's call path, or a kernel that
cannot take a shape, fails here rather than on the GPU."""

import sys
from pathlib import Path

import pytest
import torch

from mlaserve.kernels.mla_decode.rules import DecodeCall, DecodeDevice, DecodeShape
from mlaserve.kernels.mla_decode.tuning import tuned_plan

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks" / "diagnose"))

H200 = DecodeDevice("sm_90", 132, triton=True, gluon=True)
CACHES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp8_e4m3": torch.float8_e4m3fn,
    "int8": torch.int8,
}


def check(heads: int, cache: str, batch: int, max_len: int, variants: list[dict]) -> None:
    shape = DecodeShape(heads, 512, 64, CACHES[cache], torch.bfloat16, 64)
    for kw in variants:
        plan = tuned_plan(shape, DecodeCall(batch, max_len), H200, **kw)
        assert kw.get("kernel") in (None, plan.kernel)


SECTIONS = ["page_ahead", "wgmma", "widen_bits", "wgmma8", "fp8_dots", "fp8_splits", "fp8_rule", "decode_options",
            "wide_warps", "fp8_tiles", "fp8_breakdown", "decode_breakdown"]  # fmt: skip


@pytest.mark.parametrize("section", SECTIONS)
def test_h200_diagnose_variants_run_on_an_h200(monkeypatch, section):
    import h200_diagnose

    calls = []

    def decode_variants(bf16_variants, fp8_variants, wide_variants, cases=h200_diagnose.DECODE_CASES):
        for batch, heads, _, max_len, with_fp8 in cases:
            calls.append((heads, "bf16", batch, max_len, bf16_variants if heads <= 16 else wide_variants))
            if with_fp8:
                calls.append((heads, "fp8_e4m3", batch, max_len, fp8_variants))
        return {"rows": []}

    def eight_bit_variants(cases, variants, caches=("fp8_e4m3", "int8")):
        calls.extend((16, cache, batch, max_len, variants) for batch, _, max_len in cases for cache in caches)
        return {"rows": []}

    def breakdown_row(batch, length, cache_dtype="bfloat16", **kwargs):
        calls.append((16, cache_dtype, batch, length, [kwargs]))
        return {}

    monkeypatch.setattr(h200_diagnose, "decode_variants", decode_variants)
    monkeypatch.setattr(h200_diagnose, "eight_bit_variants", eight_bit_variants)
    monkeypatch.setattr(h200_diagnose, "breakdown_row", breakdown_row)
    getattr(h200_diagnose, section)()
    assert calls
    for call in calls:
        check(*call)


def test_sweep_variants_run_on_an_h200():
    import decode_sweep

    for batch, length in ((64, 4096), (128, 8192)):
        check(16, "bf16", batch, length, decode_sweep.BF16_VARIANTS)
        for cache in ("fp8_e4m3", "int8"):
            check(16, cache, batch, length, decode_sweep.Q8_VARIANTS)
