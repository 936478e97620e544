"""benchmarks/gpu_prefill128.py's section at tiny sizes on the CPU interpreter (the timer stubbed): every tile and
the engine's call are checked against the reference and timed, the peers that cannot run here say why, and the
causal FLOP count is the visible pairs'."""

import pytest
import torch

pytest.importorskip("triton")

from benchmarks import gpu_prefill128 as section  # noqa: E402
from mlaserve.kernels.prefill_attn.tiles import PrefillTile  # noqa: E402


def test_causal_flops_count_each_querys_visible_keys():
    # 3 fresh queries see 1 + 2 + 3 keys; 2 queries over 5 keys see 4 + 5
    assert section.causal_flops([3, 2], [3, 5], 1, 192, 128) == 2 * 320 * (6 + 9)
    assert section.causal_flops([4], [4], 2, 1, 1) == 2 * 2 * 10 * 2


def test_the_section_runs_at_tiny_sizes_on_cpu(capsys):
    clock = iter(range(1, 1000))
    tiles = (PrefillTile(16, 16, 4, 1), PrefillTile(32, 16, 4, 1))
    report = section.prefill128(
        lambda call: float(next(clock)), device="cpu", dtype=torch.float32, heads=2,
        cases=[("tiny", [20, 5], [20, 30])], check_heads=(0, 1), tiles=tiles,
    )  # fmt: skip
    (row,) = report["rows"]
    results = row["results"]
    for name in ("triton (16, 16, 4, 1)", "triton (32, 16, 4, 1)", "triton"):
        assert results[name]["max_err"] < 1e-4 and results[name]["us"] > 0, name
    assert results["flash"]["error"].startswith("unavailable") and "us" not in results["flash+pad"]
    assert "us" not in results["fa3"]
    assert row["best_triton"] == "triton (16, 16, 4, 1)"  # the stub's clock only rises: the first timed wins
    assert list(report["tile_wins"]) == ["triton (16, 16, 4, 1)", "triton (32, 16, 4, 1)"]
    assert row["GFLOP"] == section.causal_flops([20, 5], [20, 30], 2, 192, 128) / 1e9
    assert "best tile" in capsys.readouterr().out


def test_a_kernel_off_the_reference_is_not_timed(monkeypatch):
    from mlaserve.kernels.prefill_attn import triton_prefill

    real = triton_prefill.prefill_attention_tiled
    monkeypatch.setattr(
        triton_prefill, "prefill_attention_tiled", lambda *a, **kw: (real(*a, **kw)[0] + 1, None)
    )
    report = section.prefill128(
        lambda call: 1.0, device="cpu", dtype=torch.float32, heads=1, cases=[("tiny", [8], [8])],
        check_heads=(0,), tiles=(PrefillTile(16, 16, 4, 1),),
    )  # fmt: skip
    wrong = report["rows"][0]["results"]["triton (16, 16, 4, 1)"]
    assert "not timed" in wrong["error"] and "us" not in wrong
